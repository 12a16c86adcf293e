//! The bus's side of a subscription: one [`Subscriber`] entry per subscription,
//! shared by the trie, cached routes and in-flight work.
//!
//! An entry is an `active` flag in front of a *sink*: a handler, an async
//! handler, or a stream mailbox. Clearing the flag is what unsubscribing
//! means to delivery: every delivery checks it immediately before calling the
//! sink, so after [`Subscriber::deactivate`] returns no delivery that had not
//! already started will begin, even one queued long before. Removing the entry
//! from the trie afterwards is housekeeping.
//!
//! Handler sinks are stored as `Subscriber<dyn Sink<T>>`, a single allocation
//! holding the flag and the user's closure, so a delivery is one pointer read,
//! one flag load and one indirect call.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::message::Message;
use crate::subscription::Handler;
use crate::sync::{AtomicBool, Ordering};

/// A delivery's future, when a handler is async.
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Something a message can be delivered to, from any thread.
pub(crate) trait Sink<T>: Send + Sync {
    /// Runs a sync handler to completion (`None`), or starts an async one and
    /// returns its future, not yet polled.
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture>;
}

/// One subscription's entry.
pub(crate) struct Subscriber<S: ?Sized> {
    id: u64,
    active: AtomicBool,
    pub(crate) sink: S,
}

impl<S> Subscriber<S> {
    pub(crate) fn new(id: u64, sink: S) -> Self {
        Self {
            id,
            active: AtomicBool::new(true),
            sink,
        }
    }
}

impl<S: ?Sized> Subscriber<S> {
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn is_active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    /// Stops all deliveries that have not started yet. Returns whether this
    /// call was the one that deactivated it.
    pub(crate) fn deactivate(&self) -> bool {
        self.active.swap(false, Ordering::AcqRel)
    }
}

/// A handler subscription's entry.
pub(crate) type HandlerEntry<T> = Arc<Subscriber<dyn Sink<T>>>;

/// Adapts a [`Handler`] to a sink.
pub(crate) struct SyncSink<H>(pub(crate) H);

impl<T, H: Handler<T>> Sink<T> for SyncSink<H> {
    #[inline]
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        self.0.handle(message);
        None
    }
}

/// Adapts an async handler (a closure returning a future) to a sink.
pub(crate) struct AsyncSink<F>(pub(crate) F);

impl<T, F, Fut> Sink<T> for AsyncSink<F>
where
    F: Fn(Arc<Message<T>>) -> Fut + Send + Sync,
    Fut: Future<Output = ()> + Send + 'static,
{
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        Some(Box::pin((self.0)(Arc::clone(message))))
    }
}
