//! Task slots: every task a bus spawns (a task runner, or an async delivery
//! continued after its first poll) holds a [`TaskPermit`], and at most
//! `max_inflight_tasks` are out at once. Taking one never waits: with none
//! left, a task runner is not started (the overflow policy applies), and an
//! async delivery waits in the gauge's [`WaitingRoom`] for the next slot
//! given back (`waiting_room.rs`).

use std::sync::Arc;

use super::waiting_room::WaitingRoom;
use super::Env;
use crate::registry::entry::BoxFuture;
use crate::sync::{fence, AtomicUsize, Ordering};

/// Counts a bus's live tasks against its cap, and keeps the async
/// deliveries waiting for one of them.
pub(crate) struct TaskGauge {
    live: AtomicUsize,
    cap: usize,
    /// Pending async deliveries that found every slot taken; as many as
    /// the cap.
    pub(crate) waiting: WaitingRoom<BoxFuture>,
}

impl TaskGauge {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            live: AtomicUsize::new(0),
            cap,
            waiting: WaitingRoom::new(cap),
        }
    }

    /// The most tasks alive at once.
    pub(crate) fn cap(&self) -> usize {
        self.cap
    }

    /// Tasks alive now.
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }

    /// Takes a slot if one is free.
    pub(crate) fn try_take(&self) -> bool {
        let mut live = self.live.load(Ordering::Relaxed);
        loop {
            if live >= self.cap {
                return false;
            }
            match self.live.compare_exchange_weak(
                live,
                live + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(now) => live = now,
            }
        }
    }

    /// Gives a slot back. The fence orders it before the caller's look at
    /// the waiting room (`waiting_room.rs`, "The hand-off").
    pub(crate) fn give_back(&self) {
        self.live.fetch_sub(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
    }
}

/// The right to keep one task alive; released on drop, when it starts the
/// next waiting async delivery, if any.
pub(crate) struct TaskPermit(Arc<Env>);

impl TaskPermit {
    /// The bus the slot belongs to.
    pub(crate) fn env(&self) -> &Arc<Env> {
        &self.0
    }

    pub(crate) fn acquire(env: &Arc<Env>) -> Option<Self> {
        env.tasks.try_take().then(|| Self(Arc::clone(env)))
    }

    /// A slot past the cap, for a delivery that must not wait for one
    /// (`pending.rs`): counted like any, so others see the bus as full for
    /// longer.
    pub(super) fn past_cap(env: &Arc<Env>) -> Self {
        env.tasks.live.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(env))
    }

    /// Wraps a slot already taken with [`TaskGauge::try_take`].
    pub(super) fn adopt(env: &Arc<Env>) -> Self {
        Self(Arc::clone(env))
    }
}

impl Drop for TaskPermit {
    fn drop(&mut self) {
        self.0.tasks.give_back();
        if self.0.tasks.waiting.has_waiting() {
            super::pending::start_waiting(&self.0);
        }
    }
}
