//! Findings of the thirty-sixth self-review. Each test has a time limit.

#[cfg(feature = "mqtt")]
#[path = "common/bridge_support.rs"]
mod bridge_support;
#[cfg(feature = "mqtt")]
#[path = "common/mosquitto.rs"]
mod mosquitto;

#[cfg(feature = "mqtt")]
mod mqtt_sys_prefix {
    use std::time::Duration;

    use crate::bridge_support::{inline_bus, limit, start_node, subscribed, until, Seen};
    use crate::mosquitto::Mosquitto;
    use blazesub::bridge::Bridge;
    use blazesub::Bus;
    use bytes::Bytes;

    async fn node(bus: &Bus<Bytes>, url: &str, name: &str, ex: &[&str], im: &[&str]) -> Bridge {
        let builder = Bridge::builder(bus)
            .mqtt(url)
            .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(200));
        start_node(builder, name, ex, im).await
    }

    /// mosquitto refuses a client's publish to any topic that begins with
    /// the four bytes `$SYS` (`strncmp(topic, "$SYS", 4)`), `$SYSTEM/x`
    /// included, and likewise one that begins with `$share`, and at QoS 0
    /// says nothing. Each export must then either
    /// arrive or be counted dropped; none may be counted sent and vanish.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sys_prefixed_exports_arrive_or_are_counted_dropped() {
        let broker = Mosquitto::start();
        limit(60, async {
            let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
            let filters = ["$SYSTEM/#", "$SYSx", "$shared/#", "plain/#"];
            let ba = node(&a, &broker.url(), "a", &filters, &[]).await;
            let bb = node(&b, &broker.url(), "b", &[], &filters).await;
            let seen = Seen::default();
            let _subs: Vec<_> = filters
                .iter()
                .map(|f| b.subscribe(f, seen.handler()).unwrap())
                .collect();
            subscribed(&bb, 4).await;
            for topic in ["$SYSTEM/x", "$SYSx", "$shared/x", "plain/z"] {
                a.publish(topic, Bytes::from_static(b"m")).unwrap();
            }
            until(
                || seen.topics().contains(&"plain/z".to_owned()),
                || format!("{:?} {:?} {:?}", seen.topics(), ba.stats(), bb.stats()),
            )
            .await;
            until(
                || {
                    let s = ba.stats();
                    s.sent + s.dropped == 4
                },
                || format!("{:?}", ba.stats()),
            )
            .await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            let (sa, sb) = (ba.stats(), bb.stats());
            assert_eq!(
                sa.sent,
                sb.received,
                "exports counted sent that nobody received: seen {:?}, a {sa:?}, b {sb:?}",
                seen.sorted_topics()
            );
            ba.close().await.unwrap();
            bb.close().await.unwrap();
        })
        .await;
    }
}

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
