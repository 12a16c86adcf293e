//! `close()` is cancel-safe (DESIGN.md §6): a `close` future dropped before
//! it completes (here by `tokio::time::timeout`) leaves the bus closed, and
//! once the last accepted delivery finishes the streams still end and the
//! worker threads still stop. One test in its own process, because it counts
//! this process's `blazesub-worker` threads.

mod common;

use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Message};
use common::{wait_until, Gate, MODES};

const LIMIT: Duration = Duration::from_secs(20);

/// Threads of this process whose name starts like the pool's workers
/// (Linux truncates names to 15 bytes).
fn worker_threads() -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter_map(|task| std::fs::read_to_string(task.path().join("comm")).ok())
        .filter(|name| name.starts_with("blazesub-worke"))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_close_still_ends_streams_and_stops_workers() {
    for mode in MODES {
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(2)
            .build()
            .unwrap();
        let gate = Arc::new(Gate::new());
        let held = Arc::clone(&gate);
        let _blocked = bus
            .subscribe_async("job", move |_m: Arc<Message<u32>>| {
                let held = Arc::clone(&held);
                async move {
                    tokio::task::spawn_blocking(move || held.wait())
                        .await
                        .unwrap();
                }
            })
            .unwrap();
        let mut stream = bus.subscribe_stream("job").unwrap();
        bus.publish("job", 1).unwrap();

        let cancelled = tokio::time::timeout(Duration::from_millis(50), bus.close()).await;
        assert!(
            cancelled.is_err(),
            "{mode:?}: close finished while a delivery was blocked"
        );
        assert!(bus.is_closed(), "{mode:?}");
        assert!(
            bus.publish("job", 2).is_err(),
            "{mode:?}: publish after close"
        );

        gate.open();
        // The stream yields what it held, then ends, though nobody awaits close.
        let first = tokio::time::timeout(LIMIT, stream.recv()).await.unwrap();
        assert_eq!(first.map(|m| *m.data()), Some(1), "{mode:?}");
        let end = tokio::time::timeout(LIMIT, stream.recv()).await;
        assert!(matches!(end, Ok(None)), "{mode:?}: the stream never ended");
        assert_eq!(bus.inflight_messages(), 0, "{mode:?}");
        if mode == DeliveryMode::WorkerPool && cfg!(target_os = "linux") {
            assert!(
                wait_until(LIMIT, || worker_threads() == 0),
                "{mode:?}: {} worker threads still running",
                worker_threads()
            );
        }
        drop(bus);
    }
}
