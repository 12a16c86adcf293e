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

    use crate::bridge_support::mqtt_node;
    use crate::bridge_support::{inline_bus, limit, subscribed, until, Seen};
    use crate::mosquitto::Mosquitto;
    use bytes::Bytes;

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
            let ba = mqtt_node(&a, &broker.url(), "a", &filters, &[], false).await;
            let bb = mqtt_node(&b, &broker.url(), "b", &[], &filters, false).await;
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

#[cfg(feature = "mqtt")]
mod mqtt_refused_filter_unsubscribe {
    use std::time::Duration;

    use crate::bridge_support::mqtt_node;
    use crate::bridge_support::{inline_bus, limit, subscribed, Seen};
    use crate::mosquitto::Mosquitto;
    use bytes::Bytes;

    /// A local filter subscribed before the bridge's first ConnAck, whose
    /// SUBSCRIBE turns out over the broker's Maximum Packet Size, is left
    /// out of the broker's subscriptions. Unsubscribing it locally must
    /// not send the broker an UNSUBSCRIBE just as far over the limit: that
    /// fails the connection (a reconnect, and what is in flight on it).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unsubscribing_a_filter_the_broker_could_not_take_keeps_the_connection() {
        let broker = Mosquitto::start_with("max_packet_size 1000\n");
        limit(60, async {
            let a = inline_bus::<Bytes>();
            let ba = mqtt_node(&a, &broker.url(), "a", &["t/#"], &[], false).await;
            let long_local = format!("{}/+", "x".repeat(2_000));
            // The long filter must reach the table before the first
            // ConnAck (the broker's limit unknown yet), then be left out
            // of the broker's subscriptions there; after the ConnAck it is
            // refused outright, so try a few bridges until one races so.
            let mut in_table = None;
            for _ in 0..10 {
                let c = inline_bus::<Bytes>();
                let early = c.subscribe(&long_local, |_| {}).unwrap();
                let seen = Seen::default();
                let t = c.subscribe("t/#", seen.handler()).unwrap();
                let bc = mqtt_node(&c, &broker.url(), "c", &[], &["#"], false).await;
                let both = tokio::time::timeout(Duration::from_secs(2), async {
                    while bc.stats().upstream_subscriptions < 2 {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                    }
                })
                .await;
                if both.is_ok() {
                    in_table = Some((c, early, seen, t, bc));
                    break;
                }
                bc.close().await.unwrap();
            }
            let (_c, early, seen, _t, bc) =
                in_table.expect("the long filter never reached the table");
            subscribed(&bc, 2).await;
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            let before = bc.stats().reconnects;
            drop(early);
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            for i in 0..20 {
                a.publish(&format!("t/{i}"), Bytes::from_static(b"1"))
                    .unwrap();
            }
            let _ = tokio::time::timeout(Duration::from_secs(3), async {
                while seen.len() < 20 {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            })
            .await;
            let (sa, sc) = (ba.stats(), bc.stats());
            assert_eq!(
                (sc.reconnects, seen.len()),
                (before, 20),
                "the UNSUBSCRIBE cost the connection: a {sa:?}; c {sc:?}"
            );
        })
        .await;
    }
}

mod serving_publisher_and_helpers {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock};
    use std::time::Duration;

    use blazesub::{Bus, DeliveryMode};

    use crate::common;

    /// A lone publish of 128 subscriptions gets helper runner tasks (the
    /// module docs of `dispatch/tasks.rs`: "they claim its units beside
    /// the lane's task ... a big fan-out uses every core"). A publisher that
    /// then finds its lane full and serves it takes that publish; it must
    /// leave units to the helpers, which the other workers have stolen.
    /// With `Runner::claims_rest` in `serve`, it claimed all 128 at once and
    /// ran them alone, one after another (before: 0-64 of them).
    #[test]
    #[ignore = "open: claims_rest in Tasks::serve takes a lone publish from its helpers; no small fix that keeps the close fix"]
    fn helpers_still_share_a_lone_publish_its_serving_publisher_takes() {
        for round in 0..5 {
            let rt = common::runtime(4);
            let bus = Bus::<u32>::builder()
                .delivery(DeliveryMode::TaskPerSubscriber)
                .workers(4)
                .max_inflight_tasks(4)
                .max_concurrent_subscriptions(8)
                .runtime(rt.handle().clone())
                .build()
                .unwrap();
            let publisher = Arc::new(OnceLock::new());
            let here = Arc::new(AtomicU64::new(0));
            let _subs: Vec<_> = (0..128)
                .map(|_| {
                    let (publisher, here) = (Arc::clone(&publisher), Arc::clone(&here));
                    bus.subscribe("t", move |m| {
                        if *m.data() == 1 && publisher.get() == Some(&std::thread::current().id()) {
                            here.fetch_add(1, Ordering::SeqCst);
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    })
                    .unwrap()
                })
                .collect();
            let (b, p) = (bus.clone(), Arc::clone(&publisher));
            let published = common::within(Duration::from_secs(20), "the publishes", move || {
                rt.block_on(async move {
                    // On a runtime thread: the lane's task and helpers land
                    // in its queues, and the second publish finds the lane
                    // (of one publish) full.
                    tokio::spawn(async move {
                        p.set(std::thread::current().id()).unwrap();
                        b.publish("t", 1).unwrap();
                        b.publish("t", 2).unwrap();
                    })
                    .await
                    .unwrap();
                });
                rt
            });
            assert!(
                common::wait_until(Duration::from_secs(10), || bus.inflight_messages() == 0),
                "{:?}",
                bus.stats()
            );
            drop(published);
            let ran = here.load(Ordering::SeqCst);
            assert!(
                ran < 128,
                "round {round}: the serving publisher ran all {ran} of the lone publish itself"
            );
        }
    }
}
