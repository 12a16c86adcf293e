//! A job pool on a shared subscription: workers join the group
//! `$share/workers/jobs/#`, each job goes to exactly one of them, the least
//! loaded by default, so a slow worker gets fewer jobs; a worker that leaves
//! hands the jobs still queued for it to the others.
//!
//! `cargo run --release --example job_pool` (about a second)

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, Message, SharePolicy};

#[tokio::main]
async fn main() -> Result<(), blazesub::Error> {
    let bus: Bus<u32> = Bus::builder()
        .workers(4)
        .share_policy(SharePolicy::LeastLoaded) // the default, shown
        .build()?;

    // Three handler workers: one of them is slow.
    let done: Vec<Arc<AtomicU64>> = (0..3).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let mut workers = Vec::new();
    for (i, counter) in done.iter().enumerate() {
        let counter = Arc::clone(counter);
        let pause = if i == 0 {
            Duration::from_millis(20)
        } else {
            Duration::from_millis(1)
        };
        workers.push(
            bus.subscribe("$share/workers/jobs/#", move |_: &Message<u32>| {
                std::thread::sleep(pause); // the work
                counter.fetch_add(1, Ordering::Relaxed);
            })?,
        );
    }
    // And a stream worker that takes a few jobs, then leaves with some queued.
    let mut batch_worker = bus.subscribe_stream("$share/workers/jobs/#")?;

    let mut stream_done = 0;
    for job in 0..600u32 {
        let reached = bus.publish(&format!("jobs/{}", job % 8), job)?;
        assert_eq!(reached, 1, "a group counts once");
        if job % 50 == 0 && job < 250 {
            while batch_worker.try_recv().is_ok() {
                stream_done += 1;
            }
        }
        if job == 300 {
            println!(
                "the batch worker leaves with {} jobs queued: they go to the others",
                batch_worker.len()
            );
            drop(batch_worker);
            batch_worker = bus.subscribe_stream("$share/other/none")?; // a placeholder
        }
        // A burst just before the batch worker leaves: every worker is busy.
        if !(250..=300).contains(&job) {
            tokio::time::sleep(Duration::from_micros(1_500)).await;
        }
    }
    // Close first: every queued job has run (a member dropped before would
    // have its queue handed to the others, or counted dropped with none left).
    bus.close().await?;
    drop(batch_worker);
    drop(workers);

    for (i, counter) in done.iter().enumerate() {
        let kind = if i == 0 { "slow" } else { "fast" };
        println!(
            "handler worker {i} ({kind}): {} jobs",
            counter.load(Ordering::Relaxed)
        );
    }
    println!("batch (stream) worker: {stream_done} jobs before it left");
    let stats = bus.stats();
    println!(
        "published {}, delivered {}, dropped {}",
        stats.published, stats.delivered, stats.dropped
    );
    Ok(())
}
