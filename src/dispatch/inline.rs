//! `DeliveryMode::Inline`: the publisher runs every delivery before `publish`
//! returns.
//!
//! The job is never shared, so it lives on the publisher's stack; there is no
//! queue, no task, and no overflow for handlers. An async handler still
//! pending after its first poll continues as a task, within
//! `max_inflight_tasks` (see `pending.rs`).

use std::sync::Arc;

use super::pending::{self, Place};
use super::{Env, Fanout, Runner};
use crate::registry::entry::BoxFuture;
use crate::stats::Tally;

/// Runs every delivery; returns how many were dropped (async deliveries
/// cancelled at the task cap under `Overflow::Drop` or `Overflow::Error`).
pub(super) fn run<T: Send + Sync + 'static>(job: &Fanout<T>, env: &Arc<Env>) -> usize {
    let mut tally = Tally::default();
    job.run(env, &mut InlineRunner { env }, &mut tally);
    env.counters.add(&tally);
    tally.dropped as usize
}

struct InlineRunner<'a> {
    env: &'a Arc<Env>,
}

impl<T: Send + Sync + 'static> Runner<T> for InlineRunner<'_> {
    fn has_idle_capacity(&self) -> bool {
        false
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        false
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        pending::settle(delivery, self.env, Place::Publisher, tally);
    }
}
