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
//! An entry is also what the user's [`Subscription`](crate::Subscription)
//! handle points to (as a [`Control`]): one allocation per subscription holds
//! the flag, the trie (weakly, for unsubscribing) and the user's closure, so a
//! delivery is one pointer read, one flag load and one indirect call, and
//! consecutive subscriptions' entries sit next to each other in memory. The
//! entry is kept small (48 bytes for a closure holding one `Arc`) because a
//! fan-out walks thousands of them; the filter string lives in the handle.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Weak};

use crate::message::Message;
use crate::quiesce::Running;
use crate::receiver::Mailbox;
use crate::subscription::{Control, Handler};
use crate::sync::{AtomicBool, Ordering};
use crate::trie::{Handlers, Streams, Trie};

/// A delivery's future, when a handler is async.
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Something a message can be delivered to, from any thread.
pub(crate) trait Sink<T>: Send + Sync {
    /// Runs a sync handler to completion (`None`), or starts an async one and
    /// returns its future, not yet polled.
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture>;
}

/// One subscription's entry. `repr(C)` keeps the flag next to the sink, in
/// the line a delivery touches.
#[repr(C)]
pub(crate) struct Subscriber<T, S: ?Sized> {
    trie: Weak<Trie<T>>,
    id: u64,
    active: AtomicBool,
    pub(crate) sink: S,
}

impl<T, S> Subscriber<T, S> {
    pub(crate) fn new(id: u64, trie: Weak<Trie<T>>, sink: S) -> Self {
        Self {
            trie,
            id,
            active: AtomicBool::new(true),
            sink,
        }
    }
}

impl<T, S: ?Sized> Subscriber<T, S> {
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
pub(crate) type HandlerEntry<T> = Arc<Subscriber<T, dyn Sink<T>>>;

/// How an entry with a sink of this type leaves the trie: the three sink
/// types live in different sets.
pub(crate) trait SinkKind<T>: Sized + 'static {
    fn remove(trie: &Trie<T>, filter: &str, entry: &Subscriber<T, Self>) -> bool;

    /// Rebuilds the entry's set without its dead entries, so a removed entry
    /// is released now rather than at the next compaction.
    fn compact(trie: &Trie<T>, filter: &str);

    /// The deliveries of this sink still running outside a runner (async
    /// handlers only).
    fn running(&self) -> Option<Arc<Running>> {
        None
    }
}

fn remove_handler<T: 'static>(
    trie: &Trie<T>,
    filter: &str,
    entry: &Subscriber<T, dyn Sink<T>>,
) -> bool {
    trie.remove::<Handlers>(filter, entry)
}

impl<T: 'static, H: Handler<T>> SinkKind<T> for SyncSink<H> {
    fn remove(trie: &Trie<T>, filter: &str, entry: &Subscriber<T, Self>) -> bool {
        remove_handler(trie, filter, entry)
    }

    fn compact(trie: &Trie<T>, filter: &str) {
        trie.compact::<Handlers>(filter);
    }
}

impl<T, F, Fut> SinkKind<T> for AsyncSink<F>
where
    T: 'static,
    F: Fn(Arc<Message<T>>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    fn remove(trie: &Trie<T>, filter: &str, entry: &Subscriber<T, Self>) -> bool {
        remove_handler(trie, filter, entry)
    }

    fn compact(trie: &Trie<T>, filter: &str) {
        trie.compact::<Handlers>(filter);
    }

    fn running(&self) -> Option<Arc<Running>> {
        Some(Arc::clone(&self.running))
    }
}

impl<T: Send + Sync + 'static> SinkKind<T> for Mailbox<T> {
    fn remove(trie: &Trie<T>, filter: &str, entry: &Subscriber<T, Self>) -> bool {
        trie.remove::<Streams>(filter, entry)
    }

    fn compact(trie: &Trie<T>, filter: &str) {
        trie.compact::<Streams>(filter);
    }
}

/// What the user's handle sees of an entry (before its sink's type is erased).
impl<T: Send + Sync + 'static, S: SinkKind<T> + Send + Sync> Control for Subscriber<T, S> {
    fn id(&self) -> u64 {
        self.id
    }

    fn remove(&self, filter: &str) -> bool {
        match self.trie.upgrade() {
            Some(trie) => S::remove(&trie, filter, self),
            None => self.deactivate(),
        }
    }

    fn remove_releasing(&self, filter: &str) -> Option<Arc<Running>> {
        if let Some(trie) = self.trie.upgrade() {
            S::remove(&trie, filter, self);
            S::compact(&trie, filter);
        } else {
            self.deactivate();
        }
        self.sink.running()
    }
}

/// Adapts a [`Handler`] to a sink.
pub(crate) struct SyncSink<H>(pub(crate) H);

impl<T, H: Handler<T>> Sink<T> for SyncSink<H> {
    #[inline]
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        self.0.handle(message);
        None
    }
}

/// Adapts an async handler (a closure returning a future) to a sink, counting
/// its deliveries still running.
pub(crate) struct AsyncSink<F> {
    handler: F,
    running: Arc<Running>,
}

impl<F> AsyncSink<F> {
    pub(crate) fn new(handler: F) -> Self {
        Self {
            handler,
            running: Arc::new(Running::new()),
        }
    }
}

impl<T, F, Fut> Sink<T> for AsyncSink<F>
where
    F: Fn(Arc<Message<T>>) -> Fut + Send + Sync,
    Fut: Future<Output = ()> + Send + 'static,
{
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture> {
        let future = (self.handler)(Arc::clone(message));
        Some(Box::pin(self.running.track(future)))
    }
}
