//! A price service answering requests, run as three instances of one shared
//! subscription: a load-balanced service in-process. Also: asking nobody
//! fails at once, a slow answer times out, and a health check gathers the
//! answers of every service with `request_many` on a filter.
//!
//! `cargo run --release --example price_service` (about a second)

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use blazesub::{Bus, Error, Message};

#[derive(Debug, Clone)]
enum Msg {
    Quote { symbol: String },
    Price { cents: u64, instance: u32 },
    Ping,
    Pong(&'static str),
}

#[tokio::main]
async fn main() -> Result<(), blazesub::Error> {
    let bus: Bus<Msg> = Bus::builder().build()?;

    // Three instances of the price service share the requests.
    let mut instances = Vec::new();
    for instance in 1..=3u32 {
        let responder = bus.clone();
        instances.push(
            bus.subscribe("$share/pricing/rpc/price", move |m: &Message<Msg>| {
                if let Msg::Quote { symbol } = m.data() {
                    let cents = symbol.bytes().map(u64::from).sum::<u64>() * 10;
                    responder.reply(m, Msg::Price { cents, instance }).unwrap();
                }
            })?,
        );
    }

    // Health checks, one subscription per component.
    for name in ["pricing", "orders", "billing"] {
        let responder = bus.clone();
        instances.push(
            bus.subscribe(&format!("health/{name}"), move |m: &Message<Msg>| {
                responder.reply(m, Msg::Pong(name)).unwrap();
            })?,
        );
    }

    // A slow service.
    let responder = bus.clone();
    instances.push(
        bus.subscribe_async("rpc/report", move |m: Arc<Message<Msg>>| {
            let responder = responder.clone();
            async move {
                tokio::time::sleep(Duration::from_millis(300)).await;
                let _ = responder.reply(&m, Msg::Pong("report")); // too late
            }
        })?,
    );

    let started = Instant::now();
    let mut served_by = BTreeMap::new();
    let mut last_eurusd = 0;
    for i in 0..3_000 {
        let symbol = ["EURUSD", "GBPUSD", "USDJPY"][i % 3].to_string();
        let reply = bus
            .request(
                "rpc/price",
                Msg::Quote { symbol },
                Duration::from_millis(500),
            )
            .await?;
        if let Msg::Price { cents, instance } = reply.data() {
            *served_by.entry(*instance).or_insert(0) += 1;
            if i % 3 == 0 {
                last_eurusd = *cents;
            }
        }
    }
    println!(
        "3,000 quotes in {:?} (EURUSD at {last_eurusd} cents); served by instance: {served_by:?}",
        started.elapsed()
    );

    match bus
        .request("rpc/weather", Msg::Ping, Duration::from_secs(30))
        .await
    {
        Err(Error::NoResponders { topic }) => println!("nobody serves {topic}: told at once"),
        other => println!("unexpected: {other:?}"),
    }
    match bus
        .request("rpc/report", Msg::Ping, Duration::from_millis(100))
        .await
    {
        Err(Error::Timeout { topic, waited }) => println!("{topic}: no answer within {waited:?}"),
        other => println!("unexpected: {other:?}"),
    }

    let pongs = bus
        .request_many("health/+", Msg::Ping, Duration::from_millis(100), 10)
        .await?;
    let names: Vec<_> = pongs
        .iter()
        .filter_map(|m| match m.data() {
            Msg::Pong(name) => Some(*name),
            _ => None,
        })
        .collect();
    println!("health: {names:?} answered");

    tokio::time::sleep(Duration::from_millis(300)).await; // the slow reply comes, late
    println!(
        "subscriptions left: {} (the services; no reply topic), late replies: {}",
        bus.subscriptions_count(),
        bus.stats().late_replies
    );
    drop(instances);
    bus.close().await?;
    Ok(())
}
