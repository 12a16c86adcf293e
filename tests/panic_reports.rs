//! The warning a caught handler panic logs names the subscription that
//! panicked (its `Subscription::id`), after its set has grown and been
//! compacted: a handler entry does not hold its id, the set keeps the ids
//! beside its slots (`registry/subset.rs`), and this checks they stay in
//! step with the entries through both. In a binary of its own because it
//! replaces the process-wide panic hook.

mod common;

use std::panic::PanicHookInfo;
use std::sync::{Arc, Mutex};

use blazesub::{Bus, Config, DeliveryMode, Message};
use common::QuietPanics;

/// The payload of the panics this test causes on purpose.
const INTENTIONAL: &str = "intentional test panic";

fn is_intentional(info: &PanicHookInfo<'_>) -> bool {
    info.payload().downcast_ref::<&str>() == Some(&INTENTIONAL)
}

/// A `tracing` subscriber keeping the `subscription` field of every event.
struct Reports(Arc<Mutex<Vec<u64>>>);

impl tracing::Subscriber for Reports {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        struct Subscription(Option<u64>);
        impl tracing::field::Visit for Subscription {
            fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
                if field.name() == "subscription" {
                    self.0 = Some(value);
                }
            }
            fn record_debug(&mut self, _: &tracing::field::Field, _: &dyn std::fmt::Debug) {}
        }
        let mut named = Subscription(None);
        event.record(&mut named);
        if let Some(id) = named.0 {
            self.0.lock().unwrap().push(id);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn a_panic_report_names_the_subscription_that_panicked_after_its_set_changed() {
    let _quiet = QuietPanics::install(is_intentional);
    let reports = Arc::new(Mutex::new(Vec::new()));
    // `Inline`: the report is logged on this thread, where the subscriber
    // is the default.
    tracing::subscriber::with_default(Reports(Arc::clone(&reports)), || {
        let bus: Bus<u32> = Bus::new(Config {
            delivery: DeliveryMode::Inline,
            ..Config::default()
        })
        .expect("bus");
        // Nine on one filter: the set grows from four slots to sixteen.
        // Subscription `i` panics on the message `i`. Each handler owns an
        // `Arc`, so a removal compacts the set at once (a handler with
        // nothing to release waits for more to go).
        let owned = Arc::new(());
        let mut subscriptions: Vec<_> = (0..9u32)
            .map(|i| {
                let owned = Arc::clone(&owned);
                bus.subscribe("jobs/done", move |m: &Message<u32>| {
                    let _ = &owned;
                    if *m.data() == i {
                        std::panic::panic_any(INTENTIONAL);
                    }
                })
                .expect("subscribe")
            })
            .map(Some)
            .collect();
        let ids: Vec<u64> = subscriptions
            .iter()
            .map(|s| s.as_ref().unwrap().id())
            .collect();
        // A small set is compacted on every removal: the survivors move
        // to new slots, and their ids with them.
        for gone in [0, 2, 4, 6] {
            subscriptions[gone].take().unwrap().unsubscribe();
        }
        assert_eq!(
            Arc::strong_count(&owned),
            6,
            "the removed were compacted away"
        );
        for value in [1, 5, 8, 2] {
            bus.publish("jobs/done", value).expect("publish");
        }
        assert_eq!(bus.stats().handler_panics, 3, "2's subscription is gone");
        assert_eq!(*reports.lock().unwrap(), [ids[1], ids[5], ids[8]]);
    });
}
