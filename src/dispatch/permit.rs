//! Task slots: every task a bus spawns (a task runner, or an async delivery
//! continued after its first poll) holds a [`TaskPermit`], and at most
//! `max_inflight_tasks` are out at once. Taking one never waits: with none
//! left, the caller applies the overflow policy. Two kinds of publisher can
//! neither wait nor block for one (see `pending.rs`); their deliveries take
//! slots past the cap, up to the cap again, and beyond that are dropped
//! and counted.

use std::sync::Arc;

use super::Env;
use crate::sync::{AtomicUsize, Ordering};

/// Counts a bus's live tasks against its cap.
pub(crate) struct TaskGauge {
    live: AtomicUsize,
    cap: usize,
}

impl TaskGauge {
    pub(crate) fn new(cap: usize) -> Self {
        Self {
            live: AtomicUsize::new(0),
            cap,
        }
    }

    /// Tasks alive now.
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

/// The right to keep one task alive; released on drop.
pub(crate) struct TaskPermit(Arc<Env>);

impl TaskPermit {
    /// The bus the slot belongs to.
    pub(crate) fn env(&self) -> &Arc<Env> {
        &self.0
    }
}

impl TaskPermit {
    pub(crate) fn acquire(env: &Arc<Env>) -> Option<Self> {
        Self::acquire_below(env, env.tasks.cap)
    }

    /// A slot past the cap, for a pending delivery whose publisher can
    /// neither block for it nor leave it to a runner (see `pending.rs`): up
    /// to the cap again, so at most twice `max_inflight_tasks` tasks are
    /// alive, all counted in `live_tasks`; `None` beyond.
    pub(crate) fn acquire_past_cap(env: &Arc<Env>) -> Option<Self> {
        Self::acquire_below(env, env.tasks.cap.saturating_mul(2))
    }

    fn acquire_below(env: &Arc<Env>, limit: usize) -> Option<Self> {
        let gauge = &env.tasks;
        let mut live = gauge.live.load(Ordering::Relaxed);
        loop {
            if live >= limit {
                return None;
            }
            match gauge.live.compare_exchange_weak(
                live,
                live + 1,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(Self(Arc::clone(env))),
                Err(now) => live = now,
            }
        }
    }
}

impl Drop for TaskPermit {
    fn drop(&mut self) {
        self.0.tasks.live.fetch_sub(1, Ordering::Relaxed);
    }
}
