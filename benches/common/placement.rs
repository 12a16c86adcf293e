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
//! [`ThreadTimes`] is the second look: each thread's time on a core and
//! time kept waiting for one across a burst (`/proc/self/task/*/schedstat`),
//! printed per repetition by the cliff bench's service pass and by the
//! fanout bench's own-counters pass (`worker_pool` setups).
//!
//! Opt-in (`BLAZESUB_PLACEMENT=1`, or `=threads` for [`ThreadTimes`]
//! alone): the sampler is a thread waking every
//! millisecond, which the timed figures should not carry by default. It is
//! not free: reading every thread's `stat` each millisecond took 6-9 ms of
//! CPU per 40 ms burst in the twenty-fifth session, a third party on two
//! cores, so under it the pool's workers wait for a core more than without
//! it. [`ThreadTimes`] alone reads `/proc` only before and after a burst.
//! Linux only.

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
        // `BLAZESUB_PLACEMENT=threads`: only each thread's times, which cost
        // nothing during the burst; the sampler is a third busy thread.
        let threads_only = std::env::var_os("BLAZESUB_PLACEMENT").is_some_and(|v| v == "threads");
        if !wanted() || threads_only || !std::path::Path::new("/proc/self/task").exists() {
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

/// Each thread's scheduler accounting at one moment (Linux `schedstat`):
/// time on a core and time runnable but waiting for one. Compared across a
/// burst, it says which threads did the work and which were kept off a core,
/// the two facts that tell a stacked pair of threads (long waits) from two
/// threads sharing one topic's work (two pool workers running).
pub struct ThreadTimes(Vec<ThreadTime>);

struct ThreadTime {
    tid: String,
    name: String,
    run_ns: u64,
    wait_ns: u64,
}

impl ThreadTimes {
    /// Every thread of the process now; `None` unless [`wanted`] on Linux.
    pub fn now() -> Option<Self> {
        if !wanted() {
            return None;
        }
        let tasks = std::fs::read_dir("/proc/self/task").ok()?;
        let threads = tasks
            .flatten()
            .filter_map(|task| {
                let path = task.path();
                let stat = std::fs::read_to_string(path.join("schedstat")).ok()?;
                let mut fields = stat.split_whitespace().map(|f| f.parse::<u64>().ok());
                let (run_ns, wait_ns) = (fields.next()??, fields.next()??);
                let name = std::fs::read_to_string(path.join("comm")).ok()?;
                Some(ThreadTime {
                    tid: task.file_name().to_string_lossy().into_owned(),
                    name: name.trim().to_owned(),
                    run_ns,
                    wait_ns,
                })
            })
            .collect();
        Some(Self(threads))
    }

    /// The threads that ran at least a millisecond since `before`, busiest
    /// first: "name/tid ran R ms, waited W ms".
    pub fn since(&self, before: &Self) -> String {
        let mut busy: Vec<(u64, String)> = self
            .0
            .iter()
            .filter_map(|now| {
                let then = before.0.iter().find(|then| then.tid == now.tid)?;
                let ran = now.run_ns.saturating_sub(then.run_ns);
                let waited = now.wait_ns.saturating_sub(then.wait_ns);
                (ran >= 1_000_000).then(|| {
                    let line = format!(
                        "{}/{} ran {:.1} ms, waited {:.1} ms",
                        now.name,
                        now.tid,
                        ran as f64 / 1e6,
                        waited as f64 / 1e6
                    );
                    (ran, line)
                })
            })
            .collect();
        busy.sort_by_key(|(ran, _)| std::cmp::Reverse(*ran));
        busy.into_iter()
            .map(|(_, line)| line)
            .collect::<Vec<_>>()
            .join("; ")
    }
}
