//! Deliveries made outside a publish's job, on the calling thread: a
//! retained snapshot handed to a new handler subscription before `subscribe`
//! returns.
//!
//! # Contract
//! - The delivery runs inside a runner bracket of the bus's
//!   [`Quiescence`](quiesce::Quiescence), so `unsubscribe_and_wait` waits for it like any
//!   other; an async one finished in place counts as held by this stack
//!   (a `close` awaited in it does not wait for it).
//! - It is counted like any other: delivered, or a caught panic. An async
//!   handler's future is accepted as in flight before its first poll, and
//!   one still pending then continues as the overflow policy says for a
//!   publisher (`pending.rs`). A caller that holds a publish token (a
//!   retained snapshot's subscriber, which `close` waits for) admits it
//!   under that token, even once `close` has begun; any other caller
//!   admits it as a publish would, so on a bus already closing it is
//!   dropped unpolled, and counted.
//! - The caller holds no lock of the bus.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use super::pending::{self, Handed, Place};
use super::{report_panic, Env};
use crate::message::Message;
use crate::registry::entry::Sink;
use crate::registry::quiesce;
use crate::stats::{PublishGuard, Tally};

/// Delivers `message` to `sink` now, on this thread, and counts it; an
/// async handler's future is admitted under `held`, the caller's token, if
/// given (see the module docs).
pub(crate) fn deliver_now<T: Send + Sync + 'static>(
    sink: &dyn Sink<T>,
    message: &Arc<Message<T>>,
    env: &Arc<Env>,
    held: Option<&mut PublishGuard<'_>>,
) {
    let _presence = env.quiescence.enter();
    let mut tally = Tally::default();
    match catch_unwind(AssertUnwindSafe(|| sink.deliver(message))) {
        Ok(None) => tally.delivered += 1,
        // In flight, and held by this stack, from before its first poll: a
        // `close` awaited in it (at once, or once it is finished in place)
        // does not wait for it, and the bus cannot close under it between
        // its first poll and its admission.
        Ok(Some(started)) => {
            if admit(env, held) {
                let held = quiesce::HeldHere::new(&env.quiescence, 1);
                let polled = catch_unwind(AssertUnwindSafe(|| {
                    pending::first_poll(started, env.handle.as_ref())
                }));
                match polled {
                    Ok(None) => {
                        tally.delivered += 1;
                        tally.finished += 1;
                    }
                    Err(panic) => {
                        tally.panics += 1;
                        tally.finished += 1;
                        report_panic(message.topic(), None, panic.as_ref());
                    }
                    Ok(Some(future)) => {
                        if let Handed::Back(future) =
                            pending::settle(future, env, Place::Publisher, &mut tally)
                        {
                            // Only a task runner gets a future back; finish
                            // it here.
                            pending::cancel(future);
                            tally.dropped += 1;
                            tally.finished += 1;
                        }
                    }
                }
                drop(held);
            } else {
                // The bus closed meanwhile: never polled.
                pending::cancel(started);
                tally.dropped += 1;
            }
        }
        Err(panic) => {
            tally.panics += 1;
            report_panic(message.topic(), None, panic.as_ref());
        }
    }
    env.counters.add(&tally);
}

/// Counts one delivery in flight: under the caller's token if it holds
/// one, else as a publish of its own (refused once the bus is closing).
fn admit(env: &Env, held: Option<&mut PublishGuard<'_>>) -> bool {
    match held {
        Some(token) => {
            token.extend(1);
            true
        }
        None => env
            .counters
            .begin_publish()
            .map(|mut admitted| admitted.accept(1))
            .is_ok(),
    }
}
