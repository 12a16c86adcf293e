//! The thirty-sixth session's adversarial review of the delivery
//! contracts (DESIGN.md §9): combinations the other suites do not reach.
//! Every wait is under a time limit, so a bug fails instead of hanging.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Batch, Bus, DeliveryMode, Message, Overflow};

const LIMIT: Duration = Duration::from_secs(10);

/// A sync handler (plain or ordered) that blocks on `close` in
/// `TaskPerSubscriber` mode, run by a publisher that serves its full lane
/// while its own publish waits for room (`Overflow::Wait`, one task slot):
/// `close` finishes once everything else has drained, without waiting for
/// that publisher's own publish, which cannot be delivered before the
/// handler returns. Before, it waited for it until `close_timeout`.
#[test]
fn close_from_a_sync_handler_on_a_publisher_serving_its_lane_does_not_wait_for_its_publish() {
    for ordered in [false, true] {
        for round in 0..4 {
            let what = format!("ordered: {ordered}, round {round}");
            let rt = common::runtime(2);
            let bus = Bus::<u32>::builder()
                .delivery(DeliveryMode::TaskPerSubscriber)
                .workers(2)
                .max_inflight_tasks(1)
                .close_timeout(Duration::from_secs(2))
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let (tx, closed) = std::sync::mpsc::channel();
            let inner = bus.clone();
            let close_on_3 = move |m: &blazesub::Message<u32>| {
                if *m.data() == 3 {
                    let _ = tx.send(common::block_on(inner.close()));
                }
            };
            let _slow = bus
                .subscribe("t", |_| std::thread::sleep(Duration::from_millis(2)))
                .unwrap();
            let _closer = if ordered {
                bus.subscribe_ordered("t", close_on_3).unwrap()
            } else {
                bus.subscribe("t", close_on_3).unwrap()
            };
            let publisher = {
                let bus = bus.clone();
                std::thread::spawn(move || {
                    for i in 0..10 {
                        if bus.publish("t", i).is_err() {
                            break;
                        }
                    }
                })
            };
            let result = closed.recv_timeout(LIMIT).expect("close never returned");
            assert!(result.is_ok(), "{what}: {result:?}");
            publisher.join().unwrap();
            assert!(
                common::wait_until(LIMIT, || bus.inflight_messages() == 0),
                "{what}: {:?}",
                bus.stats()
            );
        }
    }
}

/// `TaskPerSubscriber` at its task cap under `Overflow::CallerRuns`: the
/// publisher runs its publish itself, and a sync handler of it (plain or
/// ordered) blocks on `close` there. `close` finishes once everything else
/// has drained (here an async delivery holding the only task slot a while),
/// without waiting for the rest of the publish the handler runs in, which
/// cannot run before it returns. Before, it waited for that publish's other
/// delivery until `close_timeout`.
#[test]
fn close_from_a_sync_handler_run_by_its_publisher_at_the_task_cap_does_not_wait_for_its_publish() {
    close_from_a_handler_run_by_its_publisher_at_the_task_cap(Batch::Chunked);
}

/// The same under `Batch::Single`, where a publish below the threshold
/// is a unit per subscription: the publisher ran the units no task could
/// take one after another, each claimed as it began, so `close` waited
/// for the ones after the handler's.
#[test]
fn close_from_a_sync_handler_run_by_its_publisher_at_the_task_cap_under_batch_single() {
    close_from_a_handler_run_by_its_publisher_at_the_task_cap(Batch::Single);
}

fn close_from_a_handler_run_by_its_publisher_at_the_task_cap(batch: Batch) {
    for ordered in [false, true] {
        let what = format!("{batch:?}, ordered: {ordered}");
        let rt = common::runtime(2);
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::TaskPerSubscriber)
            .workers(2)
            .max_inflight_tasks(1)
            .overflow(Overflow::CallerRuns)
            .batch(batch)
            .close_timeout(Duration::from_secs(2))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        // Holds the only task slot for a while: everything else, for close.
        let _busy = bus
            .subscribe_async("busy", |_m| tokio::time::sleep(Duration::from_millis(100)))
            .unwrap();
        bus.publish("busy", 0).unwrap();
        let (tx, closed) = std::sync::mpsc::channel();
        let inner = bus.clone();
        let close = move |_: &Message<u32>| {
            let _ = tx.send(common::block_on(inner.close()));
        };
        // Subscribed first, so its delivery comes first in the publish.
        let _closer = if ordered {
            bus.subscribe_ordered("t", close).unwrap()
        } else {
            bus.subscribe("t", close).unwrap()
        };
        let other = Arc::new(AtomicU64::new(0));
        let _other = {
            let other = Arc::clone(&other);
            bus.subscribe("t", move |_| {
                other.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let publisher = {
            let bus = bus.clone();
            std::thread::spawn(move || bus.publish("t", 1))
        };
        let result = closed.recv_timeout(LIMIT).expect("close never returned");
        assert!(result.is_ok(), "{what}: {result:?}");
        assert_eq!(publisher.join().unwrap().ok(), Some(2), "{what}");
        // Under `Batch::Single` the other unit may go to a task once the
        // slot is free again: it runs, but not necessarily by now.
        assert!(
            common::wait_until(LIMIT, || other.load(Ordering::SeqCst) == 1),
            "{what}"
        );
        assert!(
            common::wait_until(LIMIT, || bus.inflight_messages() == 0),
            "{what}: {:?}",
            bus.stats()
        );
    }
}

/// A publisher that finds its `TaskPerSubscriber` lane full, with the
/// lane's task not running yet (here it never will: the bus's runtime is
/// a current-thread one nobody drives), serves the lane itself; a sync
/// handler of the publish it takes (plain or ordered), subscribed first,
/// blocks on `close`. `close` finishes without waiting for the rest of
/// that publish, which cannot run before the handler returns. Before, the
/// publisher claimed the publish's deliveries a few at a time, so the
/// rest was not counted as its own, and `close` waited for it until
/// `close_timeout`.
#[test]
fn close_from_a_sync_handler_on_a_publisher_serving_its_lane_does_not_wait_for_the_rest_of_the_publish(
) {
    for ordered in [false, true] {
        // Lanes of one publish.
        serve_a_lane_whose_handler_closes(2, 1, ordered);
    }
}

fn serve_a_lane_whose_handler_closes(tasks: usize, lane: u32, ordered: bool) {
    {
        let what = format!("lane of {lane}, ordered: {ordered}");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::TaskPerSubscriber)
            .workers(2)
            .max_inflight_tasks(tasks)
            .close_timeout(Duration::from_secs(2))
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let (tx, closed) = std::sync::mpsc::channel();
        let inner = bus.clone();
        let close = move |m: &Message<u32>| {
            if *m.data() == 0 {
                let _ = tx.send(common::block_on(inner.close()));
            }
        };
        let _closer = if ordered {
            bus.subscribe_ordered("t", close).unwrap()
        } else {
            bus.subscribe("t", close).unwrap()
        };
        let other = Arc::new(AtomicU64::new(0));
        let _other = {
            let other = Arc::clone(&other);
            bus.subscribe("t", move |_| {
                other.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        };
        let publisher = {
            let bus = bus.clone();
            // The last one finds the lane full.
            std::thread::spawn(move || {
                (0..=lane)
                    .map(|i| bus.publish("t", i).ok())
                    .collect::<Vec<_>>()
            })
        };
        let result = closed.recv_timeout(LIMIT).expect("close never returned");
        assert!(result.is_ok(), "{what}: {result:?}");
        let reached = publisher.join().unwrap();
        assert!(reached.iter().all(|r| *r == Some(2)), "{what}: {reached:?}");
        // The last publish waits in its lane for the lane's task: the
        // runtime runs it now.
        let drained = rt.block_on(async {
            tokio::time::timeout(LIMIT, async {
                while bus.inflight_messages() > 0 {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            })
            .await
        });
        assert!(drained.is_ok(), "{what}: {:?}", bus.stats());
        assert_eq!(other.load(Ordering::SeqCst), u64::from(lane) + 1, "{what}");
    }
}
