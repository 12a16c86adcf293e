//! Helpers for the reliability tests (`properties`, `stress`, `soak`,
//! `saturation`, `slow_consumers`, `bad_input`): the mode and policy lists,
//! a runtime to give a bus, waiting with a deadline (a test that would hang
//! fails instead), a countdown latch and a barrier that give up, the
//! process's resident memory, and durations read from the environment.
#![allow(dead_code)]

use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Batch, DeliveryMode, Overflow};

/// Every delivery mode.
pub const MODES: [DeliveryMode; 3] = [
    DeliveryMode::TaskPerSubscriber,
    DeliveryMode::WorkerPool,
    DeliveryMode::Inline,
];

/// Both batch policies.
pub const BATCHES: [Batch; 2] = [Batch::Single, Batch::Chunked];

/// Every overflow policy.
pub const POLICIES: [Overflow; 3] = [Overflow::CallerRuns, Overflow::Drop, Overflow::Error];

/// A multi-threaded tokio runtime of `threads` workers, to hand to a bus with
/// `BusBuilder::runtime` (so tests can stay plain `#[test]`s that block).
pub fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// Runs `f` on a thread of its own and returns its result, or panics naming
/// `what` if it has not finished within `limit` (the thread is left behind:
/// the test has failed anyway). A panic inside `f` is re-raised here.
pub fn within<R: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> R + Send + 'static,
) -> R {
    let (done, result) = std::sync::mpsc::channel();
    let worker = std::thread::Builder::new()
        .name(format!("within: {what}"))
        .spawn(move || {
            let _ = done.send(std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)));
        })
        .expect("a thread");
    match result.recv_timeout(limit) {
        Ok(Ok(value)) => {
            let _ = worker.join();
            value
        }
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => panic!("{what}: still running after {limit:?}; it hangs"),
    }
}

/// Polls `cond` every millisecond until it holds or `timeout` passes;
/// returns whether it held.
pub fn wait_until(timeout: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A counter that threads can wait on until it reaches a value.
#[derive(Default)]
pub struct Countdown {
    count: Mutex<usize>,
    changed: Condvar,
}

impl Countdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one and wakes the waiters.
    pub fn arrive(&self) {
        *self.count.lock().unwrap() += 1;
        self.changed.notify_all();
    }

    pub fn get(&self) -> usize {
        *self.count.lock().unwrap()
    }

    /// Waits until the count is at least `target`; false if `timeout` passed
    /// first.
    pub fn wait_for(&self, target: usize, timeout: Duration) -> bool {
        let guard = self.count.lock().unwrap();
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |count| *count < target)
            .unwrap();
        *guard >= target
    }
}

/// A barrier for `parties` threads that gives up after a timeout, so a test
/// whose threads can never all arrive fails instead of hanging.
pub struct TimedBarrier {
    parties: usize,
    state: Mutex<(usize, u64)>, // (arrived in this generation, generation)
    changed: Condvar,
}

impl TimedBarrier {
    pub fn new(parties: usize) -> Self {
        Self {
            parties,
            state: Mutex::new((0, 0)),
            changed: Condvar::new(),
        }
    }

    /// Waits until `parties` threads have called `wait` (in this round);
    /// false if `timeout` passed first. A thread that gives up leaves the
    /// round: the others keep waiting for a full set.
    pub fn wait(&self, timeout: Duration) -> bool {
        let mut state = self.state.lock().unwrap();
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            *state = (0, generation + 1);
            self.changed.notify_all();
            return true;
        }
        let (mut state, result) = self
            .changed
            .wait_timeout_while(state, timeout, |s| s.1 == generation)
            .unwrap();
        if result.timed_out() && state.1 == generation {
            state.0 -= 1;
            return false;
        }
        true
    }
}

/// The process's resident set size in KiB (`VmRSS` of `/proc/self/status`),
/// or `None` where that file does not exist.
pub fn rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
}

/// A number from the environment variable `name`, or `default`.
pub fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(default)
}
