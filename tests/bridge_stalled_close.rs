//! `Bridge::close` on a stalled link (the broker stops reading, the
//! connection stays open), for MQTT QoS 0, QoS 1 and NATS: every export
//! counted once, and the close within its fixed waits (2 s for the
//! exporter, then the engine's own). A version that gave the publish under
//! way 2 s of its own before the exporter's closing 2 s took 6.0 s (MQTT)
//! and 7.4 s (NATS) instead of 4.0 s and 6.0 s.
#![cfg(all(feature = "mqtt", feature = "nats"))]
// Both broker helpers bring their own copy of `broker_process.rs`.
#![allow(clippy::duplicate_mod)]

#[path = "common/bridge_support.rs"]
mod bridge_support;
#[path = "common/link_proxy.rs"]
mod link_proxy;
#[path = "common/mosquitto.rs"]
mod mosquitto;
#[path = "common/nats_server.rs"]
mod nats_server;

use std::time::{Duration, Instant};

use blazesub::bridge::Bridge;
use bridge_support::{inline_bus, limit, start_node};
use bytes::Bytes;
use link_proxy::LinkProxy;

#[derive(Clone, Copy, Debug)]
enum Engine {
    Qos0,
    Qos1,
    Nats,
}

async fn stalled_close(
    engine: Engine,
    name: &str,
    n: u64,
) -> (Duration, u64, blazesub::bridge::BridgeStats) {
    let mqtt = matches!(engine, Engine::Qos0 | Engine::Qos1).then(mosquitto::Mosquitto::start);
    let nats = matches!(engine, Engine::Nats).then(nats_server::NatsServer::start);
    let port = mqtt
        .as_ref()
        .map(|m| m.port)
        .unwrap_or_else(|| nats.as_ref().unwrap().port);
    let proxy = LinkProxy::start(port).await;
    let a = inline_bus::<Bytes>();
    let builder = Bridge::builder(&a);
    let builder = match engine {
        Engine::Qos0 => builder.mqtt(proxy.url()),
        Engine::Qos1 => builder
            .mqtt(proxy.url())
            .at_least_once(Duration::from_secs(60)),
        Engine::Nats => builder.nats(format!("nats://127.0.0.1:{}", proxy.port)),
    }
    .reconnect_backoff(Duration::from_millis(20), Duration::from_millis(100));
    let sender = start_node(builder, name, &["st/#"], &[]).await;
    proxy.stall();
    for i in 0..n {
        a.publish(&format!("st/{i}"), Bytes::from(vec![7; 1024]))
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t = Instant::now();
    sender.close().await.unwrap();
    let took = t.elapsed();
    let stats = sender.stats();
    drop(proxy);
    (took, n, stats)
}

async fn check(engine: Engine, name: &str, bound: Duration) {
    limit(60, async {
        let (took, n, stats) = stalled_close(engine, name, 20_000).await;
        eprintln!("{engine:?}: close took {took:?}; {stats:?}");
        assert_eq!(
            stats.sent + stats.dropped,
            n,
            "{engine:?}: every export once: {stats:?} (close {took:?})"
        );
        assert!(
            took < bound,
            "{engine:?}: close on a stalled link took {took:?} (bound {bound:?})"
        );
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_close_qos0() {
    check(Engine::Qos0, "r34c-q0", Duration::from_millis(5_300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_close_qos1() {
    check(Engine::Qos1, "r34c-q1", Duration::from_millis(5_300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_close_nats() {
    check(Engine::Nats, "r34c-n", Duration::from_millis(6_900)).await;
}
