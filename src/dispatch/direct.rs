//! Deliveries made outside a publish's job, on the calling thread: a
//! retained snapshot handed to a new handler subscription before `subscribe`
//! returns, and the queue of a shared group's leaving stream member handed
//! to a handler member.
//!
//! # Contract
//! - The delivery runs inside a runner bracket of the bus's
//!   [`Quiescence`], so `unsubscribe_and_wait` waits for it like any
//!   other; an async one finished in place counts as held by this stack
//!   (a `close` awaited in it does not wait for it).
//! - It is counted like any other: delivered, or a caught panic. An async
//!   handler's future still pending after its first poll is accepted as in
//!   flight and continues as the overflow policy says for a publisher
//!   (`pending.rs`), or, on a bus already closed, is dropped and counted.
//! - The caller holds no lock of the bus.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::pending::{self, Handed, Place};
use super::{report_panic, Env};
use crate::message::Message;
use crate::registry::entry::Sink;
use crate::registry::quiesce::{self, Quiescence};
use crate::stats::Tally;

/// Delivers `message` to `sink` now, on this thread, and counts it.
pub(crate) fn deliver_now<T: Send + Sync + 'static>(
    sink: &dyn Sink<T>,
    message: &Arc<Message<T>>,
    env: &Arc<Env>,
) {
    let _presence = env.quiescence.enter();
    let mut tally = Tally::default();
    match catch_unwind(AssertUnwindSafe(|| sink.deliver(message))) {
        Ok(None) => tally.delivered += 1,
        Ok(Some(started)) => match pending::first_poll(started, env.handle.as_ref()) {
            None => tally.delivered += 1,
            Some(future) => match env.counters.begin_publish() {
                Ok(mut admitted) => {
                    admitted.accept(1);
                    // Held by this stack while it is settled: finished in
                    // place, a `close` awaited in it must not wait for it.
                    let held = HeldHere::one(&env.quiescence);
                    let handed = pending::settle(future, env, Place::Publisher, &mut tally);
                    drop(held);
                    if let Handed::Back(future) = handed {
                        // Only a task runner gets a future back; finish it here.
                        drop(future);
                        tally.dropped += 1;
                        tally.finished += 1;
                    }
                }
                Err(_) => {
                    drop(future);
                    tally.dropped += 1;
                }
            },
        },
        Err(panic) => {
            tally.panics += 1;
            report_panic(message.topic(), None, panic.as_ref());
        }
    }
    env.counters.add(&tally);
}

/// One delivery held by this thread's stack (see `quiesce::held_here`),
/// until dropped, even by a panic.
struct HeldHere<'a>(&'a Quiescence);

impl<'a> HeldHere<'a> {
    fn one(quiescence: &'a Quiescence) -> Self {
        quiesce::hold(quiescence, 1);
        Self(quiescence)
    }
}

impl Drop for HeldHere<'_> {
    fn drop(&mut self) {
        quiesce::unhold(self.0, 1);
    }
}
