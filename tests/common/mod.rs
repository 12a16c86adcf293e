//! Helpers shared by the integration tests: the mode, batch and policy
//! lists, per-message hit counters, a gate that blocks handlers until the
//! test opens it, polling with a deadline, running a step with a time limit
//! (a test that would hang fails instead), a countdown latch and a barrier
//! that give up, a runtime to give a bus, the process's resident memory,
//! numbers read from the environment, and a handler that records the thread
//! each delivery ran on.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use blazesub::{Batch, DeliveryMode, Overflow};

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

/// Both batch policies.
pub const BATCHES: [Batch; 2] = [Batch::Single, Batch::Chunked];

/// Every overflow policy.
pub const POLICIES: [Overflow; 4] = [
    Overflow::Wait,
    Overflow::CallerRuns,
    Overflow::Drop,
    Overflow::Error,
];

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

type Hook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static>;

/// Silences the panics `intentional` recognises (others still print, so a
/// failing assertion stays readable) and restores the previous hook when
/// dropped. The hook is global, so holders take turns.
pub struct QuietPanics {
    previous: Option<std::sync::Arc<Hook>>,
    _serial: std::sync::MutexGuard<'static, ()>,
}

impl QuietPanics {
    pub fn install(intentional: fn(&std::panic::PanicHookInfo<'_>) -> bool) -> Self {
        static SERIAL: Mutex<()> = Mutex::new(());
        let serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let previous: std::sync::Arc<Hook> = std::sync::Arc::new(std::panic::take_hook());
        let delegate = std::sync::Arc::clone(&previous);
        std::panic::set_hook(Box::new(move |info| {
            if !intentional(info) {
                delegate(info);
            }
        }));
        Self {
            previous: Some(previous),
            _serial: serial,
        }
    }
}

impl Drop for QuietPanics {
    fn drop(&mut self) {
        // A failing test is unwinding: the hook cannot be changed then, and
        // the filtering one passes its message through anyway.
        if std::thread::panicking() {
            return;
        }
        if let Some(previous) = self.previous.take() {
            let _quiet = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| previous(info)));
        }
    }
}

/// A tiny executor: polls `future` on this thread, parking between polls
/// (for code that must block where no tokio runtime may: a handler on a pool
/// worker, a plain thread).
pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = std::task::Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

/// Runs this test binary's test named `child_case` in a child process with
/// `env` set to `case` (for what could abort the process: a stack overflow,
/// a memory bound); gives how it ended ("exit N", "signal N" or "timeout"
/// after `limit`) and its stdout and stderr.
pub fn run_child(env: &str, case: &str, limit: Duration) -> (String, String) {
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["child_case", "--exact", "--nocapture", "--test-threads=1"])
        .env(env, case)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            let how = match (status.code(), status.signal()) {
                (Some(code), _) => format!("exit {code}"),
                (None, Some(signal)) => format!("signal {signal}"),
                _ => "unknown".into(),
            };
            return (how, text);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return ("timeout".into(), String::new());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Subscribes `n` handlers of `topic` that each count their calls in one
/// shared counter.
pub fn counters(
    bus: &blazesub::Bus<u32>,
    topic: &str,
    n: usize,
) -> (
    Vec<blazesub::Subscription>,
    std::sync::Arc<std::sync::atomic::AtomicU64>,
) {
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let subs = (0..n)
        .map(|_| {
            let count = std::sync::Arc::clone(&count);
            bus.subscribe(topic, move |_| {
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    (subs, count)
}

/// Per topic: the thread name of each delivery, in order, and counts of
/// deliveries started and finished.
#[derive(Default)]
pub struct Seen {
    pub threads: Mutex<Vec<String>>,
    pub started: std::sync::atomic::AtomicUsize,
    pub done: std::sync::atomic::AtomicUsize,
}

/// One subscription on `topic` recording where each delivery runs in
/// `seen`; message 1 waits at `gate` (if any) before it returns.
pub fn subscribe_recording(
    bus: &blazesub::Bus<u32>,
    topic: &str,
    gate: Option<std::sync::Arc<Gate>>,
    seen: &std::sync::Arc<Seen>,
) -> blazesub::Subscription {
    let seen = std::sync::Arc::clone(seen);
    bus.subscribe(topic, move |message: &blazesub::Message<u32>| {
        let thread = std::thread::current().name().unwrap_or("?").to_owned();
        seen.threads.lock().unwrap().push(thread);
        seen.started.fetch_add(1, Ordering::SeqCst);
        if *message.data() == 1 {
            if let Some(gate) = &gate {
                gate.wait();
            }
        }
        seen.done.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap()
}

/// Opens its gates when dropped, however a test ends: no handler waits
/// out a gate's limit.
pub struct OpenOnDrop(pub Vec<std::sync::Arc<Gate>>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.iter().for_each(|gate| gate.open());
    }
}
