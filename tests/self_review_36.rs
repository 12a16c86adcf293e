//! Findings of the thirty-sixth self-review. Each test has a time limit.

mod common;

mod single_units_at_the_task_cap {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    use blazesub::{Batch, Bus, DeliveryMode, Overflow};

    use crate::common;

    /// `Batch::Single` below the threshold is a task per subscription. A
    /// publisher that finds no task slot for one runs that unit itself
    /// (`Stats::caller_runs`: "because ... the task cap was full"); once
    /// tasks have finished and given their slots back, the units after it
    /// go to tasks again, in parallel. It must not run every later unit
    /// itself, one after another, while slots stand free.
    #[test]
    fn a_publisher_without_a_task_slot_runs_only_the_units_no_task_can_take() {
        for overflow in [Overflow::CallerRuns, Overflow::Wait] {
            let rt = common::runtime(4);
            let bus = Bus::<u32>::builder()
                .delivery(DeliveryMode::TaskPerSubscriber)
                .workers(4)
                .max_inflight_tasks(2)
                .batch(Batch::Single)
                .max_concurrent_subscriptions(64)
                .overflow(overflow)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let on_publisher = Arc::new(AtomicU64::new(0));
            let _subs: Vec<_> = (0..8)
                .map(|_| {
                    let on_publisher = Arc::clone(&on_publisher);
                    bus.subscribe("t", move |_| {
                        if std::thread::current().name() == Some("publisher") {
                            on_publisher.fetch_add(1, Ordering::SeqCst);
                            // Long enough for the tasks to finish meanwhile.
                            std::thread::sleep(Duration::from_millis(300));
                        } else {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                    })
                    .unwrap()
                })
                .collect();
            let publisher = {
                let bus = bus.clone();
                std::thread::Builder::new()
                    .name("publisher".into())
                    .spawn(move || bus.publish("t", 1))
                    .unwrap()
            };
            let reached = common::within(Duration::from_secs(20), "the publish", move || {
                publisher.join().unwrap()
            });
            assert_eq!(reached.ok(), Some(8), "{overflow:?}");
            assert!(
                common::wait_until(Duration::from_secs(10), || bus.inflight_messages() == 0),
                "{overflow:?}: {:?}",
                bus.stats()
            );
            let (ran_here, stats) = (on_publisher.load(Ordering::SeqCst), bus.stats());
            assert_eq!(stats.delivered, 8, "{overflow:?}: {stats:?}");
            assert!(
                ran_here <= 3,
                "{overflow:?}: the publisher ran {ran_here} of 8 units itself while task slots were free: {stats:?}"
            );
            assert_eq!(stats.caller_runs, ran_here, "{overflow:?}: {stats:?}");
        }
    }
}
