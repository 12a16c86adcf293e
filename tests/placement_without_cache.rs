//! Placement on a bus without a route cache (`route_cache_capacity(0)`):
//! every publish builds its route afresh, with a fresh `Home` whose place
//! is the topic's hash again, so a move kept only in the home was
//! forgotten at the next publish. Two busy topics at one home parted for
//! one publish, and the moved topic's next publish (resident now at the
//! other worker, which its own work keeps busy) found its hash's worker
//! taken and nothing idle, and went back there as a guest, behind the
//! other topic. Now the place remembers its resident, and a route
//! resident elsewhere goes there (`placement.rs`). Found by a review of
//! the second placement build; failed there, passes now. The cache-on
//! twin passed on both.
//!
//! Made deterministic with gates and a one-ticket queue per worker under
//! `Overflow::Error`: `a` holds worker w with one more publish queued there
//! (w's queue full), `b` moved to the other worker o holds it with its
//! queue empty. `b`'s next publish belongs at o (room); sent to w it is
//! refused (`Overloaded`).

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Overflow};
use common::{subscribe_recording, wait_until, Gate, OpenOnDrop, Seen};

const LIMIT: Duration = Duration::from_secs(20);

/// Two topics that run on one worker on a quiet bus (same hash home).
fn same_home_pair(bus: &Bus<u32>) -> (String, String) {
    let seen = Arc::new(Seen::default());
    let gate = Arc::new(Gate::default());
    gate.open();
    let mut by_thread: std::collections::HashMap<String, Vec<String>> = Default::default();
    for n in 0..32 {
        let topic = format!("probe{n}");
        let sub = subscribe_recording(bus, &topic, Some(Arc::clone(&gate)), &seen);
        // A few quiet publishes; the thread most of them ran on.
        let mut threads = Vec::new();
        for _ in 0..3 {
            let before = seen.done.load(Ordering::SeqCst);
            bus.publish(&topic, 100).unwrap();
            assert!(wait_until(LIMIT, || seen.done.load(Ordering::SeqCst) == before + 1));
            threads.push(seen.threads.lock().unwrap().last().unwrap().clone());
            std::thread::sleep(Duration::from_millis(2));
        }
        drop(sub);
        if threads.iter().all(|t| *t == threads[0]) {
            let list = by_thread.entry(threads[0].clone()).or_default();
            list.push(topic);
            if list.len() == 2 {
                return (list[0].clone(), list[1].clone());
            }
        }
    }
    panic!("no two probe topics share a worker");
}

/// `Ok(())` if `b`'s second publish went where `b` is resident; `Err` with
/// why if the setup did not hold (retried), panics on the defect.
fn try_once(cache: usize) -> Result<(), String> {
    let bus: Bus<u32> = Bus::builder()
        .delivery(DeliveryMode::WorkerPool)
        .workers(2)
        .queue_capacity(2)
        .overflow(Overflow::Error)
        .route_cache_capacity(cache)
        .build()
        .unwrap();
    let (ta, tb) = same_home_pair(&bus);
    let (a, b) = (Arc::new(Seen::default()), Arc::new(Seen::default()));
    let (ga, gb) = (Arc::new(Gate::default()), Arc::new(Gate::default()));
    let _open = OpenOnDrop(vec![Arc::clone(&ga), Arc::clone(&gb)]);
    let _subs = [
        subscribe_recording(&bus, &ta, Some(Arc::clone(&ga)), &a),
        subscribe_recording(&bus, &tb, Some(Arc::clone(&gb)), &b),
    ];
    std::thread::sleep(Duration::from_millis(20));

    // `a` holds its worker w.
    bus.publish(&ta, 1).unwrap();
    assert!(wait_until(LIMIT, || a.started.load(Ordering::SeqCst) == 1));
    // `b` (same home) finds w taken, the other idle: it moves there.
    bus.publish(&tb, 1).map_err(|e| format!("b#1: {e}"))?;
    assert!(wait_until(LIMIT, || b.started.load(Ordering::SeqCst) == 1));
    let (wa, wb) = (
        a.threads.lock().unwrap()[0].clone(),
        b.threads.lock().unwrap()[0].clone(),
    );
    if wa == wb {
        return Err("b did not move".into());
    }
    // w's one-ticket queue filled by `a`, whose home it is.
    bus.publish(&ta, 2).map_err(|e| format!("a#2: {e}"))?;
    // `b` is resident at its new worker, whose queue is empty.
    let result = bus.publish(&tb, 2);
    assert!(
        result.is_ok(),
        "b's second publish went back to the full queue of a's worker (where b is no \
         longer resident): {result:?}"
    );
    Ok(())
}

fn run(cache: usize) {
    let mut upset = Vec::new();
    for _ in 0..5 {
        match try_once(cache) {
            Ok(()) => return,
            Err(why) => upset.push(why),
        }
    }
    panic!("no try got its setup: {upset:?}");
}

#[test]
fn parted_topics_stay_apart_with_the_route_cache_on() {
    run(4096);
}

#[test]
fn parted_topics_stay_apart_with_the_route_cache_off() {
    run(0);
}
