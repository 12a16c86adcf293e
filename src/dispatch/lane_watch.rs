//! [`LaneWatch`]: the thread that finds a `TaskPerSubscriber` lane whose
//! server is stuck, and has a helper started for it.
//!
//! # Contract
//! - While any lane has publishes queued, the watcher looks at every lane
//!   each [`STALL`]. A lane that has taken nothing since the watcher's
//!   previous look (the same `started` count twice in a row, see
//!   [`Lane::stuck_look`]) is stuck: its server is in a slow handler, or its
//!   task has not run yet (tokio keeps a task spawned by a publisher that
//!   does not yield in that thread's LIFO slot). The watcher calls its
//!   `on_stuck` for it, which starts a helper task; spawned from this
//!   thread, the helper goes to the runtime's shared queue, where any free
//!   worker takes it.
//! - It sleeps while every lane is empty. A publisher that queued a publish
//!   calls [`LaneWatch::arm`] after queuing it (an atomic load while the
//!   watcher is armed). **No publish is left queued with the watcher
//!   disarmed**: the watcher disarms only after a look that found every
//!   lane empty, and then looks once more, re-arming itself if that look
//!   finds a publish. A publisher that queued after that second look (both
//!   take the lane's lock) finds the watcher disarmed and arms it. The
//!   loom model `loom_the_lane_watch_never_sleeps_on_queued_work` checks
//!   both sides of this, and that an arm wakes a watcher asleep.
//! - It knows nothing of tokio: what a stuck lane gets is `on_stuck`'s
//!   business (`tasks.rs`).

use std::sync::Arc;

use super::lane::Lane;
use super::pool::STALL;
use crate::error::Error;
use crate::sync::{AtomicBool, Condvar, Mutex, MutexGuard, Ordering};

/// See the module docs.
pub(crate) struct LaneWatch<T> {
    lanes: Vec<Arc<Lane<T>>>,
    /// Armed: looking. Read by publishers without the lock.
    armed: AtomicBool,
    state: Mutex<WatchState>,
    wake: Condvar,
}

#[derive(Default)]
struct WatchState {
    armed: bool,
    stopping: bool,
}

/// What the watcher remembers of each lane between two looks: the takes it
/// had made at the last look, if it had publishes queued then.
pub(crate) type Seen = Vec<Option<u64>>;

impl<T> LaneWatch<T> {
    /// A watch over `lanes`, disarmed, with no thread yet.
    pub(crate) fn new(lanes: Vec<Arc<Lane<T>>>) -> Self {
        Self {
            lanes,
            armed: AtomicBool::new(false),
            state: Mutex::new(WatchState::default()),
            wake: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, WatchState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ends the watcher's thread at its next wake-up.
    pub(crate) fn stop(&self) {
        self.lock().stopping = true;
        self.wake.notify_one();
    }

    /// A publisher queued a publish: make sure the watcher looks.
    pub(crate) fn arm(&self) {
        if self.armed.load(Ordering::SeqCst) {
            return;
        }
        self.armed.store(true, Ordering::SeqCst);
        self.lock().armed = true;
        self.wake.notify_one();
    }

    /// Whether the watcher is armed, both in the flag publishers read and
    /// in the state it sleeps on.
    #[cfg(all(test, loom))]
    pub(crate) fn is_armed(&self) -> bool {
        let armed = self.lock().armed;
        armed && self.armed.load(Ordering::SeqCst)
    }

    /// A fresh memory of the lanes, for [`Self::look_and_settle`].
    pub(crate) fn seen(&self) -> Seen {
        vec![None; self.lanes.len()]
    }

    /// Sleeps until armed: `false` if the watch stops instead.
    pub(crate) fn wait_armed(&self) -> bool {
        let mut state = self.lock();
        while !state.armed && !state.stopping {
            state = self.wake.wait(state).unwrap_or_else(|e| e.into_inner());
        }
        !state.stopping
    }

    /// Waits [`STALL`] between two looks: `false` if the watch stops.
    fn pause(&self) -> bool {
        let state = self.lock();
        if state.stopping {
            return false;
        }
        let (state, _) = self
            .wake
            .wait_timeout(state, STALL)
            .unwrap_or_else(|e| e.into_inner());
        !state.stopping
    }
}

impl<T: Send + Sync + 'static> LaneWatch<T> {
    /// One look at every lane (see [`Self::look`]); if none had publishes
    /// queued, disarms and looks once more, re-arming if that look finds
    /// some (see the module docs).
    pub(crate) fn look_and_settle(&self, seen: &mut Seen, on_stuck: &mut dyn FnMut(&Arc<Lane<T>>)) {
        if self.look(seen, on_stuck) {
            return;
        }
        self.lock().armed = false;
        self.armed.store(false, Ordering::SeqCst);
        if self.look(seen, on_stuck) {
            self.arm();
        }
    }

    /// Looks at every lane, calling `on_stuck` for each stuck one. Returns
    /// whether any lane has publishes queued.
    fn look(&self, seen: &mut Seen, on_stuck: &mut dyn FnMut(&Arc<Lane<T>>)) -> bool {
        let mut any = false;
        for (lane, seen) in self.lanes.iter().zip(seen.iter_mut()) {
            let Some(started) = lane.stuck_look() else {
                *seen = None;
                continue;
            };
            any = true;
            if *seen != Some(started) {
                *seen = Some(started);
                continue;
            }
            *seen = None;
            on_stuck(lane);
        }
        any
    }

    /// A watch over `lanes`, with its thread started: `on_stuck` is called
    /// there for each lane found stuck.
    pub(crate) fn start(
        lanes: Vec<Arc<Lane<T>>>,
        mut on_stuck: impl FnMut(&Arc<Lane<T>>) + Send + 'static,
    ) -> Result<Arc<Self>, Error> {
        let watch = Arc::new(Self::new(lanes));
        let watcher = Arc::clone(&watch);
        std::thread::Builder::new()
            .name("blazesub-lanes".into())
            .spawn(move || {
                let mut seen = watcher.seen();
                while watcher.wait_armed() && watcher.pause() {
                    watcher.look_and_settle(&mut seen, &mut on_stuck);
                }
            })
            .map_err(Error::Spawn)?;
        Ok(watch)
    }
}
