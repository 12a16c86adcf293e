//! A service-shaped tour of blazesub: a building-monitoring service.
//!
//! - typed messages (an `Event` enum) on MQTT topics `site/<building>/<sensor>/<kind>`;
//! - a handler subscription with a `+` wildcard keeps running averages;
//! - a stream subscription (`#` wildcard) is read by its own tokio task, in
//!   publish order, to raise alarms;
//! - an async handler "stores" alarms (it awaits, so it becomes a task);
//! - four publisher threads feed the bus, which runs handlers on a worker pool;
//! - at the end the bus is closed (draining everything) and its stats printed.
//!
//! `cargo run --release --example quickstart`

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Bus, DeliveryMode, Message, Metadata};

#[derive(Debug, Clone)]
enum Event {
    Reading { celsius: f32 },
    Alarm { reason: String },
}

const BUILDINGS: [&str; 4] = ["north", "south", "east", "west"];
const SENSORS_PER_BUILDING: usize = 50;
const READINGS_PER_SENSOR: usize = 1_000;

#[tokio::main]
async fn main() -> Result<(), blazesub::Error> {
    let started = Instant::now();
    let bus: Bus<Event> = Bus::builder()
        .delivery(DeliveryMode::WorkerPool)
        .close_timeout(Duration::from_secs(5))
        .build()?;

    // 1. A handler on every temperature reading of every building.
    let averages: Arc<Mutex<BTreeMap<String, (f64, u64)>>> = Arc::default();
    let totals = Arc::clone(&averages);
    let temperatures = bus.subscribe("site/+/+/temp", move |m: &Message<Event>| {
        if let Event::Reading { celsius } = m.data() {
            let building = m.topic().split('/').nth(1).unwrap_or("?").to_owned();
            let mut totals = totals.lock().unwrap();
            let entry = totals.entry(building).or_insert((0.0, 0));
            entry.0 += f64::from(*celsius);
            entry.1 += 1;
        }
    })?;

    // 2. A stream of everything in the north building, read in order by a task.
    let mut north = bus.subscribe_stream("site/north/#")?;
    let north_reader = tokio::spawn(async move {
        let mut seen = 0u64;
        let mut last_by_sensor: BTreeMap<String, f32> = BTreeMap::new();
        while let Some(m) = north.recv().await {
            seen += 1;
            if let Event::Reading { celsius } = m.data() {
                last_by_sensor.insert(m.topic().to_owned(), *celsius);
            }
        }
        (seen, north.lost(), last_by_sensor.len())
    });

    // 3. An async handler for alarms: pretend to write them to a database.
    let stored = Arc::new(AtomicU64::new(0));
    let store_count = Arc::clone(&stored);
    let alarms = bus.subscribe_async("site/+/+/alarm", move |m: Arc<Message<Event>>| {
        let stored = Arc::clone(&store_count);
        async move {
            tokio::time::sleep(Duration::from_millis(1)).await; // the "database"
            if let Event::Alarm { reason } = m.data() {
                let origin = m.metadata().and_then(|md| md.get("origin")).unwrap_or("?");
                assert!(!reason.is_empty() && origin.starts_with("gateway"));
                stored.fetch_add(1, Ordering::Relaxed);
            }
        }
    })?;

    // 4. Four gateway threads publish readings, and an alarm now and then.
    let gateways: Vec<_> = BUILDINGS
        .iter()
        .enumerate()
        .map(|(gateway, building)| {
            let bus = bus.clone();
            std::thread::spawn(move || -> Result<(), blazesub::Error> {
                for round in 0..READINGS_PER_SENSOR {
                    for sensor in 0..SENSORS_PER_BUILDING {
                        let celsius = 18.0 + ((round + sensor) % 70) as f32 / 10.0;
                        let topic = format!("site/{building}/s{sensor}/temp");
                        bus.publish(&topic, Event::Reading { celsius })?;
                    }
                    if round % 100 == 0 {
                        let metadata = Metadata::new().with("origin", format!("gateway-{gateway}"));
                        let event = Event::Alarm {
                            reason: format!("door open in round {round}"),
                        };
                        bus.publish_with(&format!("site/{building}/door/alarm"), event, metadata)?;
                    }
                }
                Ok(())
            })
        })
        .collect();
    for gateway in gateways {
        gateway.join().expect("gateway thread")?;
    }

    // 5. Close: refuse new publishes, wait for every accepted delivery.
    bus.close().await?;
    let (north_seen, north_lost, north_sensors) = north_reader.await.expect("reader task");

    println!("site averages:");
    for (building, (sum, count)) in averages.lock().unwrap().iter() {
        println!(
            "  {building:>5}: {:.2} °C over {count} readings",
            sum / *count as f64
        );
    }
    println!(
        "north stream: {north_seen} messages taken, {north_lost} lost to a full mailbox, \
         {north_sensors} sensors"
    );
    println!("alarms stored: {}", stored.load(Ordering::Relaxed));
    let stats = bus.stats();
    println!(
        "stats: published {}, delivered {}, dropped {}, handler panics {}, caller-runs {}, in flight {}",
        stats.published,
        stats.delivered,
        stats.dropped,
        stats.handler_panics,
        stats.caller_runs,
        stats.inflight
    );
    println!("done in {:.2?}", started.elapsed());

    drop((temperatures, alarms));
    Ok(())
}
