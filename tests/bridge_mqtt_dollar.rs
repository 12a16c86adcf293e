//! Topics that start with `$` over the MQTT bridge, against a real
//! `mosquitto`. They travel as they are (other MQTT clients see the same
//! topics), but `$SYS/...` is the broker's own: mosquitto drops a client's
//! publish there, at QoS 0 without a word. The bridge refuses such an
//! export and counts it dropped, so nothing is lost silently.
//!
//! Needs `mosquitto`; without it these tests fail, never skip. Each test
//! has a time limit.
#![cfg(feature = "mqtt")]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/mosquitto.rs"]
mod mosquitto;

use std::time::Duration;

use bridge_support::{inline_bus, limit, mqtt_node, subscribed, until, Seen};
use bytes::Bytes;
use mosquitto::Mosquitto;

/// Node a exports `$app/#`, `$SYS/#` and `plain/#`; node b imports
/// `$app/#` and `plain/#` and subscribes to them. `$app` topics cross; the
/// export of `$SYS/x` is counted dropped at a, not sent into the broker's
/// namespace, where it would vanish.
async fn dollar_topics_cross_or_are_counted(at_least_once: bool) {
    let broker = Mosquitto::start();
    limit(60, async {
        let (a, b) = (inline_bus::<Bytes>(), inline_bus::<Bytes>());
        let exports = ["$app/#", "$SYS/#", "plain/#"];
        let imports = ["$app/#", "plain/#"];
        let ba = mqtt_node(&a, &broker.url(), "a", &exports, &[], at_least_once).await;
        let bb = mqtt_node(&b, &broker.url(), "b", &[], &imports, at_least_once).await;
        let seen = Seen::default();
        let _subs: Vec<_> = imports
            .iter()
            .map(|f| b.subscribe(f, seen.handler()).unwrap())
            .collect();
        subscribed(&bb, 2).await;

        for topic in ["$app/x", "$SYS/x", "$app", "plain/z"] {
            a.publish(topic, Bytes::from(topic.as_bytes().to_vec()))
                .unwrap();
        }
        // `plain/z` goes last on one connection, in order: once it is in,
        // everything before it that the broker forwards is in too.
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
        assert_eq!(seen.sorted_topics(), ["$app", "$app/x", "plain/z"]);
        assert_eq!(
            (sa.sent, sa.dropped, sb.received),
            (3, 1, 3),
            "the $SYS/x export must be counted dropped, not sent: a {sa:?}, b {sb:?}"
        );
        ba.close().await.unwrap();
        bb.close().await.unwrap();
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dollar_topics_cross_the_mqtt_bridge_or_are_counted_qos0() {
    dollar_topics_cross_or_are_counted(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dollar_topics_cross_the_mqtt_bridge_or_are_counted_qos1() {
    dollar_topics_cross_or_are_counted(true).await;
}
