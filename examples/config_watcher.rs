//! A configuration service on a bus: the current value of each setting is a
//! retained message, so a component that starts late still gets it first,
//! then every change, per setting in order, with no gap and no duplicate.
//!
//! `cargo run --release --example config_watcher` (about a second)

use std::time::Duration;

use blazesub::{Bus, Message};

#[derive(Debug, Clone, PartialEq)]
enum Setting {
    Text(String),
    Number(u64),
}

#[tokio::main]
async fn main() -> Result<(), blazesub::Error> {
    let bus: Bus<Setting> = Bus::builder()
        .max_retained(10_000) // settings, not a fleet
        .build()?;

    // The config service publishes what it loaded at start-up.
    bus.publish_retained("config/db/url", Setting::Text("postgres://db-1".into()))?;
    bus.publish_retained("config/db/pool", Setting::Number(16))?;
    bus.publish_retained("config/http/port", Setting::Number(8080))?;

    // A component that starts later: it sees the current values first...
    let mut db_watcher = bus.subscribe_stream("config/db/#")?;
    for _ in 0..2 {
        let m = db_watcher.recv().await.expect("a retained setting");
        println!(
            "db watcher, at start: {} = {:?} (retained: {})",
            m.topic(),
            m.data(),
            m.is_retained()
        );
    }

    // ...and a handler that logs every change of any setting gets the
    // snapshot before `subscribe` returns.
    let _audit = bus.subscribe("config/#", |m: &Message<Setting>| {
        let when = if m.is_retained() {
            "current"
        } else {
            "changed"
        };
        println!("audit: {when} {} = {:?}", m.topic(), m.data());
    })?;

    // An operator changes settings while the watchers run.
    let operator = bus.clone();
    let changes = tokio::spawn(async move {
        for pool in [24, 32] {
            tokio::time::sleep(Duration::from_millis(200)).await;
            operator
                .publish_retained("config/db/pool", Setting::Number(pool))
                .unwrap();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        operator
            .publish_retained("config/db/url", Setting::Text("postgres://db-2".into()))
            .unwrap();
        // A setting that goes away: later components will not see it.
        operator.clear_retained("config/http/port");
    });

    for _ in 0..3 {
        let m = db_watcher.recv().await.expect("a change");
        println!("db watcher, live: {} = {:?}", m.topic(), m.data());
    }
    changes.await.expect("the operator finished");

    let now: Vec<String> = bus
        .retained("config/#")
        .iter()
        .map(|m| format!("{} = {:?}", m.topic(), m.data()))
        .collect();
    println!("retained now: {now:?}");
    bus.close().await?;
    let stats = bus.stats();
    println!(
        "published {}, delivered {}, retained {}, evicted {}",
        stats.published, stats.delivered, stats.retained, stats.retained_evicted
    );
    Ok(())
}
