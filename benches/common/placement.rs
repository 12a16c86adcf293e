//! Where the kernel runs the worker pool's threads during a burst.
//!
//! The service-setting figures of the default mode flip between states
//! within a process and across processes (issue 12). Sampling the pool
//! workers' scheduling state showed what decides it: three runnable threads
//! (the publisher's runtime worker and two pool workers) on two cores, and
//! which two of them the kernel stacks on one core. Handlers on counters of
//! their own run 1.2-1.5x faster with the pool workers on two cores; handlers
//! on one shared counter ran about 2-2.5x faster with both on one core (the
//! contracts bench's handler case), where the counter's line never moves (`docs/design-notes.md` §13, fifteenth
//! session).
//!
//! Opt-in (`BLAZESUB_PLACEMENT=1`): the sampler is a thread waking every
//! millisecond, which the timed figures should not carry by default. Linux
//! only: it reads `/proc/self/task/*/stat`.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

/// The pool's threads, by the name the bus gives them.
const POOL_THREAD: &str = "blazesub-worke";

/// Samples the pool workers' placement until [`Sampler::finish`].
pub struct Sampler {
    stop: Arc<AtomicBool>,
    counts: Arc<Counts>,
    thread: Option<JoinHandle<()>>,
}

#[derive(Default)]
struct Counts {
    samples: AtomicU64,
    /// Two or more pool workers running, on different cores.
    spread: AtomicU64,
    /// Two or more pool workers runnable, all on one core.
    stacked: AtomicU64,
}

/// Shares of the samples, in percent.
#[derive(Clone, Copy, Debug)]
pub struct Shares {
    pub spread: f64,
    pub stacked: f64,
}

impl std::fmt::Display for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "pool workers on two cores {:.0}%, stacked on one {:.0}%",
            self.spread, self.stacked
        )
    }
}

/// Whether the bench was asked to sample placement.
pub fn wanted() -> bool {
    std::env::var_os("BLAZESUB_PLACEMENT").is_some_and(|v| v != "0")
}

impl Sampler {
    /// Starts sampling if [`wanted`] and the platform has `/proc`.
    pub fn start() -> Option<Self> {
        if !wanted() || !std::path::Path::new("/proc/self/task").exists() {
            return None;
        }
        let stop = Arc::new(AtomicBool::new(false));
        let counts = Arc::new(Counts::default());
        let thread = {
            let (stop, counts) = (Arc::clone(&stop), Arc::clone(&counts));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    sample(&counts);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })
        };
        Some(Self {
            stop,
            counts,
            thread: Some(thread),
        })
    }

    /// Stops sampling and returns the shares.
    pub fn finish(mut self) -> Shares {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let samples = self.counts.samples.load(Ordering::Relaxed).max(1) as f64;
        let share = |n: &AtomicU64| 100.0 * n.load(Ordering::Relaxed) as f64 / samples;
        Shares {
            spread: share(&self.counts.spread),
            stacked: share(&self.counts.stacked),
        }
    }
}

/// One look at every pool worker: its state and the core it last ran on.
fn sample(counts: &Counts) {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    let mut cores = Vec::new();
    for task in tasks.flatten() {
        let path = task.path();
        let is_pool = std::fs::read_to_string(path.join("comm"))
            .is_ok_and(|name| name.starts_with(POOL_THREAD));
        if !is_pool {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue;
        };
        // Fields after the parenthesised name: state is the first, the
        // core it last ran on the 37th (`man 5 proc`, fields 3 and 39).
        let Some(rest) = stat.rfind(')').map(|end| &stat[end + 1..]) else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.first() == Some(&"R") {
            if let Some(core) = fields.get(36).and_then(|f| f.parse::<u32>().ok()) {
                cores.push(core);
            }
        }
    }
    counts.samples.fetch_add(1, Ordering::Relaxed);
    if cores.len() >= 2 {
        if cores.iter().all(|&core| core == cores[0]) {
            counts.stacked.fetch_add(1, Ordering::Relaxed);
        } else {
            counts.spread.fetch_add(1, Ordering::Relaxed);
        }
    }
}
