//! Smoke test: every mode, both batch policies, thresholds around n.
use blazesub::{Batch, Bus, DeliveryMode, Message};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smoke_all_modes() {
    for mode in [
        DeliveryMode::Inline,
        DeliveryMode::WorkerPool,
        DeliveryMode::TaskPerSubscriber,
    ] {
        for batch in [Batch::Single, Batch::Chunked] {
            for t in [1usize, 10, 99, 100, 101, 10_000] {
                let bus = Bus::<u64>::builder()
                    .delivery(mode)
                    .batch(batch)
                    .max_concurrent_subscriptions(t)
                    .build()
                    .unwrap();
                let count = Arc::new(AtomicU64::new(0));
                let mut subs = Vec::new();
                for i in 0..100 {
                    let c = count.clone();
                    let filter = match i % 3 {
                        0 => "load/+",
                        1 => "load/#",
                        _ => "load/x",
                    };
                    subs.push(
                        bus.subscribe(filter, move |_m: &Message<u64>| {
                            c.fetch_add(1, Ordering::Relaxed);
                        })
                        .unwrap(),
                    );
                }
                for k in 0..1000 {
                    assert_eq!(bus.publish("load/x", k).unwrap(), 100);
                }
                bus.close().await.unwrap();
                assert_eq!(
                    count.load(Ordering::Relaxed),
                    100_000,
                    "{mode:?} {batch:?} {t}"
                );
                let s = bus.stats();
                assert_eq!(s.delivered, 100_000);
                assert_eq!(s.inflight, 0);
            }
        }
    }
}
