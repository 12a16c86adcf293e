//! `DeliveryMode::Inline`: the publisher runs every delivery before `publish`
//! returns.
//!
//! The job is never shared, so it lives on the publisher's stack; there is no
//! queue, no task, and no overflow for handlers. An async handler still
//! pending after its first poll continues as a task, within
//! `max_inflight_tasks` (see `pending.rs`).

use std::cell::Cell;
use std::sync::Arc;

use super::pending::{self, Handed, Place};
use super::{Env, Fanout, Runner};
use crate::registry::entry::BoxFuture;
use crate::stats::Tally;

/// How deep publishes run on their publisher's thread may nest on one
/// thread (a handler publishing to a topic that reaches a handler that
/// publishes, and so on): every `Inline` publish, and in the other modes a
/// publish its publisher runs itself (a full queue or task cap under
/// `CallerRuns`, a pool handler's publish to a full queue). A publish
/// deeper than this is refused (`Error::RecursionLimit`) and counted,
/// instead of overflowing the stack.
pub(crate) const MAX_INLINE_DEPTH: usize = 64;

thread_local! {
    /// Jobs running on this thread's stack in place (see
    /// [`MAX_INLINE_DEPTH`]).
    static DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Jobs running on this thread's stack in place now.
pub(crate) fn depth() -> usize {
    DEPTH.with(Cell::get)
}

/// Counts this thread one job deeper while it runs.
pub(crate) struct Deeper;

impl Deeper {
    pub(crate) fn enter() -> Self {
        DEPTH.with(|depth| depth.set(depth.get() + 1));
        Self
    }
}

impl Drop for Deeper {
    fn drop(&mut self) {
        DEPTH.with(|depth| depth.set(depth.get().saturating_sub(1)));
    }
}

/// Runs the calls it guards at least a given depth deep: an ordered
/// handler's runner running a message published from inside one of its
/// own calls (which left the message to it) runs it as deep as that
/// publish would have, instead of back at its own depth.
pub(crate) struct AtLeast {
    previous: usize,
}

impl AtLeast {
    pub(crate) fn enter(depth: usize) -> Self {
        let previous = DEPTH.with(|current| current.replace(current.get().max(depth)));
        Self { previous }
    }
}

impl Drop for AtLeast {
    fn drop(&mut self) {
        DEPTH.with(|depth| depth.set(self.previous));
    }
}

/// The depth a publish made on this thread now runs its handlers at.
pub(crate) fn next_depth() -> usize {
    depth() + 1
}

/// Runs every delivery; returns how many were dropped (async deliveries
/// cancelled at the task cap under `Overflow::Drop` or `Overflow::Error`).
pub(super) fn run<T: Send + Sync + 'static>(job: &Fanout<T>, env: &Arc<Env>) -> usize {
    let mut tally = Tally::default();
    let _deeper = Deeper::enter();
    job.run(env, &mut InlineRunner { env }, &mut tally);
    env.counters.add(&tally);
    tally.dropped as usize
}

struct InlineRunner<'a> {
    env: &'a Arc<Env>,
}

impl<T: Send + Sync + 'static> Runner<T> for InlineRunner<'_> {
    const SHARES_JOBS: bool = false;

    fn has_idle_capacity(&self) -> bool {
        false
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        false
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) -> bool {
        matches!(
            pending::settle(delivery, self.env, Place::Publisher, tally),
            Handed::Away
        )
    }
}
