//! One subscription's entry: an `active` flag in front of a *sink* (a
//! handler, an async handler, or a stream mailbox), shared by the trie's
//! subscriber sets and the user's handle.
//!
//! # Contract
//! - Clearing the flag is what unsubscribing means to delivery: every
//!   delivery checks it immediately before calling the sink, so after
//!   [`Subscriber::deactivate`] returns no delivery that had not already
//!   started will begin, even one queued long before. Removing the entry from
//!   the trie afterwards is housekeeping.
//! - One allocation per handler subscription holds one header word and the
//!   user's closure, so a delivery is one pointer read, one flag load and
//!   one indirect call, and consecutive subscriptions' entries sit next to
//!   each other in memory. The entry is kept small because a fan-out walks
//!   thousands of them and its cost follows the cache lines it touches: the
//!   header holds both the flag and the count of pointers to the entry
//!   ([`Counted`], not `Arc`), so a closure holding two `Arc`s makes a
//!   24-byte entry, a 32-byte heap chunk, as a plain `Box` of it would
//!   (with `Arc` and a word for the flag and the id, 40 bytes: a 48-byte
//!   chunk). The id, the filter string and the way back to the trie live in
//!   the user's handle; the sets keep the ids beside their slots.
//! - A stream subscription's entry ([`StreamSubscriber`]) is held by `Arc`
//!   (a drain holds its mailbox weakly) and keeps its id beside the flag.
//! - The entry knows nothing of the trie: handles reach it through
//!   [`EntryControl`], and the trie through [`Registry`](super::Registry).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::counted::{Counted, Headed};
use super::mailbox::Mailbox;
use super::quiesce::{QueuedBehind, Running};
use crate::handler::Handler;
use crate::message::Message;
use crate::sync::{AtomicU64, Ordering};

/// The low bit of [`Subscriber`]'s state: set while it is subscribed.
const ACTIVE: u64 = 1;

/// A delivery's future, when a handler is async.
pub(crate) type BoxFuture = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A message's position in its node's ordered log, for a delivery that
/// has none (no ordered subscription was there when it was published).
pub(crate) const NO_POSITION: u64 = u64::MAX;

/// Deliveries by a publish's job that counted themselves. The job counts
/// one per delivery, except where an ordered subscription's delivery ran
/// several messages or none: that one adds what it ran here instead. A
/// plain handler's delivery never touches it, so the common case returns
/// nothing through memory (its result fits in two registers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Settled {
    /// Deliveries that counted themselves here.
    pub(crate) deliveries: u64,
    pub(crate) delivered: u64,
    pub(crate) panics: u64,
    pub(crate) dropped: u64,
}

impl Settled {
    /// One delivery ran `outcome` instead of one message.
    #[inline]
    pub(crate) fn settle(&mut self, outcome: Outcome) {
        self.settle_many(1, outcome);
    }

    /// `deliveries` deliveries ran `outcome` between them.
    #[inline]
    pub(crate) fn settle_many(&mut self, deliveries: usize, outcome: Outcome) {
        self.deliveries += deliveries as u64;
        self.delivered += u64::from(outcome.delivered);
        self.panics += u64::from(outcome.panics);
        self.dropped += u64::from(outcome.dropped);
    }
}

/// What an ordered subscription's delivery ran, for the job to count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Outcome {
    pub(crate) delivered: u32,
    pub(crate) panics: u32,
    pub(crate) dropped: u32,
}

/// Something a message can be delivered to, from any thread.
pub(crate) trait Sink<T>: Send + Sync {
    /// Runs a sync handler to completion (`None`), or starts an async one and
    /// returns its future, not yet polled.
    fn deliver(&self, message: &Arc<Message<T>>) -> Option<BoxFuture>;

    /// A publish's job delivering `message`, at `position` in the ordered
    /// log of the node this entry sits at ([`NO_POSITION`] if none): as
    /// [`Self::deliver`], except that a delivery that runs other than one
    /// message says so in `settled`.
    #[inline]
    fn deliver_at(
        &self,
        message: &Arc<Message<T>>,
        _position: u64,
        _settled: &mut Settled,
    ) -> Option<BoxFuture> {
        self.deliver(message)
    }

    /// A batch of consecutive publishes' deliveries to this subscription
    /// (one per job, in publish order, each with the message's position as
    /// in [`Self::deliver_at`]), made as one: `false` if this sink takes
    /// them one by one instead (the caller then does). A sink that takes
    /// them settles each of them in `settled`. Called only for sync sinks,
    /// after the subscription's flag was found set.
    #[inline]
    fn deliver_batch(&self, _batch: &[(&Arc<Message<T>>, u64)], _settled: &mut Settled) -> bool {
        false
    }

    /// A publish's job could not run this delivery of `message` (its queue
    /// was full under `Overflow::Drop` or `Overflow::Error`, or its runtime
    /// shut down). `Some` if the sink settled it itself (what it counted,
    /// which may include other deliveries' messages it ran); `None`: the job
    /// counts it dropped.
    #[inline]
    fn discard_at(&self, _message: &Message<T>, _position: u64) -> Option<Outcome> {
        None
    }
}

/// Whether a sink's deliveries can outlive the runner that started them.
pub(crate) trait Tracked {
    /// The sink's deliveries still running outside a runner: `Some` for
    /// async handlers only.
    fn running(&self) -> Option<Arc<Running>>;

    /// The subscription was just deactivated (its flag cleared).
    fn deactivated(&self) {}
}

/// A handler subscription's entry, held by [`Counted`] pointers.
/// `repr(C)` puts the header first, where `Counted` finds it, and keeps the
/// flag next to the sink, in the line a delivery touches.
#[repr(C)]
pub(crate) struct Subscriber<T, S: ?Sized> {
    /// [`ACTIVE`] as the low bit, and above it the count of the
    /// [`Counted`] pointers to the entry: one word for both keeps a closure
    /// holding two `Arc`s in a 32-byte heap chunk, the size of a plain
    /// `Box` of it (see `counted.rs`). The subscription's id is kept by its
    /// handle and its sets, not here.
    state: AtomicU64,
    _message: std::marker::PhantomData<fn(&T)>,
    pub(crate) sink: S,
}

// SAFETY: `repr(C)` with `state`, an `AtomicU64`, first; only `Counted`
// changes its bits above `ACTIVE`, and `Subscriber::new`, the one maker,
// starts them at zero.
#[allow(unsafe_code)]
unsafe impl<T, S: ?Sized> Headed for Subscriber<T, S> {}

impl<T, S> Subscriber<T, S> {
    /// A new active entry, and the first pointer to it.
    pub(crate) fn new(sink: S) -> Counted<Self> {
        Counted::new(Self {
            state: AtomicU64::new(ACTIVE),
            _message: std::marker::PhantomData,
            sink,
        })
    }
}

impl<T, S: ?Sized> Subscriber<T, S> {
    /// Whether the subscription is still subscribed (see [`is_active`]).
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        is_active(&self.state)
    }

    /// Stops all deliveries that have not started yet. Returns whether this
    /// call was the one that deactivated it.
    pub(crate) fn deactivate(&self) -> bool {
        deactivate(&self.state)
    }
}

impl<T: 'static, S: Sink<T> + Tracked + Send + Sync + 'static> Counted<Subscriber<T, S>> {
    /// This pointer as the handler sets hold it.
    pub(crate) fn into_handler(self) -> HandlerEntry<T> {
        // SAFETY: an unsizing coercion of the same pointer.
        #[allow(unsafe_code)]
        unsafe {
            self.unsize(|entry| entry as *mut Subscriber<T, dyn Sink<T>>)
        }
    }

    /// Another pointer to the entry, as its user's handle holds it.
    pub(crate) fn control(&self) -> Control {
        // SAFETY: an unsizing coercion of the same pointer.
        #[allow(unsafe_code)]
        let control = unsafe { self.clone().unsize(|entry| entry as *mut dyn EntryControl) };
        Control::Handler(control)
    }
}

/// A stream subscription's entry, held by `Arc`s (an async ordered
/// handler's drain holds its mailbox weakly: `retained.rs`).
pub(crate) struct StreamSubscriber<T> {
    /// The id shifted left by one, with [`ACTIVE`] as the low bit.
    state: AtomicU64,
    pub(crate) sink: Mailbox<T>,
}

impl<T> StreamSubscriber<T> {
    pub(crate) fn new(id: u64, sink: Mailbox<T>) -> Self {
        debug_assert!(id < 1 << 63, "ids are counted from zero");
        Self {
            state: AtomicU64::new(id << 1 | ACTIVE),
            sink,
        }
    }

    pub(crate) fn id(&self) -> u64 {
        self.state.load(Ordering::Relaxed) >> 1
    }

    /// Whether the subscription is still subscribed (see [`is_active`]).
    #[inline]
    pub(crate) fn is_active(&self) -> bool {
        is_active(&self.state)
    }

    /// See [`Subscriber::deactivate`].
    pub(crate) fn deactivate(&self) -> bool {
        deactivate(&self.state)
    }
}

/// Whether the entry whose state word is `state` is still subscribed.
///
/// Relaxed: the flag guards no data (the sink is published with the
/// slot that holds the entry, and never changes), and what orders this
/// read against a `deactivate` is the `SeqCst` fence every runner issues
/// when it enters (`quiesce.rs`): a load after a `SeqCst` fence sees any
/// `SeqCst` modification that precedes the fence, whatever the load's
/// own ordering. An acquire load adds no guarantee here, and it kept
/// the compiler from reusing the entry's field offsets (computed from
/// the sink's vtable) between this check and the delivery.
#[inline]
fn is_active(state: &AtomicU64) -> bool {
    state.load(Ordering::Relaxed) & ACTIVE != 0
}

/// Clears the flag in `state`; whether this call cleared it.
fn deactivate(state: &AtomicU64) -> bool {
    // SeqCst: a grace period (see `quiesce.rs`) relies on this clear
    // being ordered before its epoch flip.
    state.fetch_and(!ACTIVE, Ordering::SeqCst) & ACTIVE != 0
}

/// A handler subscription's entry.
pub(crate) type HandlerEntry<T> = Counted<Subscriber<T, dyn Sink<T>>>;

/// A stream subscription's entry.
pub(crate) type StreamEntry<T> = Arc<StreamSubscriber<T>>;

/// An async ordered subscription's mailbox holds the messages waiting for
/// its current call (see `quiesce::Caller`).
impl<T: Send + Sync> QueuedBehind for StreamSubscriber<T> {
    fn queued(&self) -> u64 {
        self.sink.len() as u64
    }
}

/// A user's handle on its entry: counted for a handler, shared for a
/// stream.
pub(crate) enum Control {
    Handler(Counted<dyn EntryControl>),
    Stream(Arc<dyn EntryControl>),
}

impl std::ops::Deref for Control {
    type Target = dyn EntryControl;

    fn deref(&self) -> &(dyn EntryControl + 'static) {
        match self {
            Control::Handler(entry) => &**entry,
            Control::Stream(entry) => &**entry,
        }
    }
}

impl<T: Send + Sync + 'static> StreamSubscriber<T> {
    /// Another pointer to the entry, as its user's handle holds it.
    pub(crate) fn control(self: &Arc<Self>) -> Control {
        Control::Stream(Arc::clone(self) as Arc<dyn EntryControl>)
    }
}

/// What a user's handle can do with its entry, without knowing `T`.
pub(crate) trait EntryControl: Send + Sync {
    /// See [`Subscriber::deactivate`].
    fn deactivate(&self) -> bool;
    /// See [`Tracked::running`].
    fn running(&self) -> Option<Arc<Running>>;
    /// Whether dropping the entry releases anything of the user's (its sink
    /// has drop glue: a closure capturing an `Arc`, a `Sender`, a mailbox).
    /// Only then is it worth compacting its set at once on removal.
    fn owns_resources(&self) -> bool;
}

impl<T, S: Tracked + Send + Sync> EntryControl for Subscriber<T, S> {
    fn deactivate(&self) -> bool {
        let first = Subscriber::deactivate(self);
        if first {
            self.sink.deactivated();
        }
        first
    }

    fn running(&self) -> Option<Arc<Running>> {
        self.sink.running()
    }

    fn owns_resources(&self) -> bool {
        std::mem::needs_drop::<S>()
    }
}

impl<T: Send + Sync> EntryControl for StreamSubscriber<T> {
    fn deactivate(&self) -> bool {
        let first = StreamSubscriber::deactivate(self);
        if first {
            self.sink.deactivated();
        }
        first
    }

    fn running(&self) -> Option<Arc<Running>> {
        self.sink.running()
    }

    fn owns_resources(&self) -> bool {
        std::mem::needs_drop::<Mailbox<T>>()
    }
}

/// A stream's deliveries are pushes its publisher makes: none run later,
/// except an async ordered handler's calls, which its drain tracks.
impl<T> Tracked for Mailbox<T> {
    fn running(&self) -> Option<Arc<Running>> {
        self.running()
    }
}

/// Adapts a [`Handler`] to a sink.
pub(crate) struct SyncSink<H>(pub(crate) H);

impl<H> Tracked for SyncSink<H> {
    fn running(&self) -> Option<Arc<Running>> {
        None
    }
}

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
    /// `bus`: its bus's [`Quiescence::id`](super::quiesce::Quiescence::id).
    pub(crate) fn new(handler: F, bus: u64) -> Self {
        Self {
            handler,
            running: Arc::new(Running::new(bus)),
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

impl<F> Tracked for AsyncSink<F> {
    fn running(&self) -> Option<Arc<Running>> {
        Some(Arc::clone(&self.running))
    }
}

// Plain unit tests: under `--cfg loom` the header is loom's atomic.
#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// The memory a fan-out walks per handler (`counted.rs`): a closure
    /// holding two `Arc`s makes a 24-byte entry, one word beyond the
    /// closure, which is what a plain `Box` of it would ask the allocator
    /// for a 32-byte chunk as well; and the handle's pointer and the sets'
    /// share the one count.
    #[test]
    fn a_handler_entry_is_one_word_beyond_its_closure() {
        let (a, b) = (Arc::new(1u64), Arc::new(2u64));
        let closure = move |_: &Message<u64>| {
            let _ = (&a, &b);
        };
        assert_eq!(std::mem::size_of_val(&closure), 16);
        let entry = Subscriber::new(SyncSink(closure));
        let control = entry.control();
        let handler = entry.into_handler();
        assert_eq!(std::mem::size_of_val(&*handler), 24);
        assert_eq!(
            std::mem::size_of::<HandlerEntry<u64>>(),
            16,
            "a slot is one fat pointer"
        );
        assert!(handler.is_active());
        assert!(control.deactivate());
        assert!(
            !handler.is_active(),
            "the handle and the set share the flag"
        );
        assert!(!control.deactivate(), "deactivated once");
    }
}
