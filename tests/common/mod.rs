//! Helpers shared by the integration tests: per-message hit counters, a gate
//! that blocks handlers until the test opens it, and polling with a deadline.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use blazesub::DeliveryMode;

/// Every delivery mode.
pub const MODES: [DeliveryMode; 3] = [
    DeliveryMode::TaskPerSubscriber,
    DeliveryMode::WorkerPool,
    DeliveryMode::Inline,
];

/// How many times each message id reached one subscription.
pub struct Hits {
    counts: Vec<AtomicU32>,
}

impl Hits {
    pub fn new(ids: usize) -> Self {
        Self {
            counts: (0..ids).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Records one delivery of message `id`.
    pub fn hit(&self, id: u32) {
        self.counts[id as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn get(&self, id: u32) -> u32 {
        self.counts[id as usize].load(Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        self.counts
            .iter()
            .map(|c| u64::from(c.load(Ordering::Relaxed)))
            .sum()
    }

    /// The first id whose count differs from `expected(id)`, with its count.
    pub fn first_mismatch(&self, expected: impl Fn(u32) -> u32) -> Option<(u32, u32)> {
        self.counts.iter().enumerate().find_map(|(id, c)| {
            let id = id as u32;
            let got = c.load(Ordering::Relaxed);
            (got != expected(id)).then_some((id, got))
        })
    }

    /// Panics naming `what` unless every id was delivered exactly once.
    pub fn assert_exactly_once(&self, what: &str) {
        if let Some((id, got)) = self.first_mismatch(|_| 1) {
            panic!("{what}: message {id} was delivered {got} times, expected exactly once");
        }
    }
}

/// A door handlers wait at until the test opens it.
pub struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    pub fn new() -> Self {
        Self {
            open: Mutex::new(false),
            opened: Condvar::new(),
        }
    }

    /// Blocks until the gate is open (at most 30 s, so a broken test ends).
    pub fn wait(&self) {
        let guard = self.open.lock().unwrap();
        let (guard, _) = self
            .opened
            .wait_timeout_while(guard, Duration::from_secs(30), |open| !*open)
            .unwrap();
        assert!(*guard, "the gate was never opened");
    }

    pub fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

/// Polls `cond` every millisecond until it holds or `timeout` passes;
/// returns whether it held. Blocks the thread: use from plain threads, or
/// from a multi-threaded runtime's test body.
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
