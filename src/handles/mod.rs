//! What users hold: [`Subscription`] (a handler subscription) and
//! [`Receiver`] (a stream subscription). Each reaches its entry through the
//! registry's `EntryControl` and its trie through `Registry`; dropping either
//! unsubscribes.

mod receiver;
mod subscription;

pub use receiver::{Receiver, RecvError, TryRecvError, TryRecvLaggedError};
pub(crate) use subscription::Links;
pub use subscription::Subscription;
