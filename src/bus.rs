//! [`Bus`]: validate → route → dispatch, plus stats and close.
//!
//! A publish reads: admit (the close barrier), validate the topic, look up
//! its route (a cache hit takes no lock and allocates nothing), wrap the value
//! in one `Arc<Message>`, push it into matching stream mailboxes, and hand the
//! handler deliveries to the dispatcher as one job. Subscribing validates the
//! filter and adds an entry to the trie; dropping the handle removes it.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use crate::closing::Closing;
use crate::config::{Config, Overflow};
use crate::dispatch::{
    inline_depth, next_inline_depth, push_to_streams, Dispatcher, Env, Fanout, Ordered, Policy,
    TaskGauge, MAX_INLINE_DEPTH,
};
use crate::error::{Error, Rejected};
use crate::handler::Handler;
use crate::handles::{Links, Receiver, Subscription};
use crate::message::{Message, Metadata};
use crate::registry::entry::{
    AsyncSink, BoxFuture, Control, Sink, StreamSubscriber, Subscriber, SyncSink, Tracked,
};
use crate::registry::mailbox::{Consumer, Mailbox};
use crate::registry::quiesce::{self, Quiescence};
use crate::registry::route::{HandlerSets, Positions, Route, RouteCache};
use crate::registry::subset::HandlerSet;
use crate::registry::trie::{Handlers, InsertError, Streams, Trie};
use crate::registry::{Kind, Registry};
use crate::request::Requests;
use crate::reserve::{reserve_now, reserve_waiting, NoRoom, Reservations};
use crate::retained::RetainedStore;
use crate::shared::SharedGroups;
use crate::stats::{Counters, PublishGuard, Stats};
use crate::stream_options::{StreamOptions, StreamOverflow};
use crate::sync::{AtomicU64, Ordering};
use crate::topic::{split_shared, validate_filter, validate_topic};

/// An in-process publish/subscribe bus carrying values of type `T`.
///
/// A cheap, cloneable handle: clones share one bus. `Send + Sync`; use it from
/// any thread, inside or outside a tokio runtime.
///
/// ```
/// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
/// use blazesub::{Bus, Message};
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
///
/// let bus: Bus<f64> = Bus::builder().build()?; // a worker pool, by default
///
/// let readings = Arc::new(AtomicU64::new(0));
/// let seen = readings.clone();
/// bus.subscribe("sensors/+/temp", move |m: &Message<f64>| {
///     assert!(m.topic().ends_with("/temp"));
///     seen.fetch_add(1, Ordering::Relaxed);
/// })?
/// .detach();
///
/// assert_eq!(bus.publish("sensors/kitchen/temp", 21.5)?, 1);
/// assert_eq!(bus.publish("sensors/kitchen/humidity", 0.4)?, 0);
///
/// bus.close().await?; // waits for the handler to have run
/// assert_eq!(readings.load(Ordering::Relaxed), 1);
/// # Ok(()) }
/// ```
pub struct Bus<T> {
    pub(crate) inner: Arc<BusInner<T>>,
}

/// A bus carrying `bytes::Bytes` payloads, as a bridge or a network service
/// would: one shared buffer per publish, whatever the subscriber count.
pub type ByteBus = Bus<bytes::Bytes>;

pub(crate) struct BusInner<T> {
    pub(crate) config: Config,
    pub(crate) trie: Arc<Trie<T>>,
    pub(crate) routes: RouteCache<T>,
    pub(crate) env: Arc<Env>,
    policy: Policy,
    pub(crate) dispatcher: Dispatcher<T>,
    next_id: AtomicU64,
    /// Retained messages (`retained.rs`).
    pub(crate) retained: RetainedStore<T>,
    /// Shared subscription groups (`shared.rs`).
    pub(crate) shared: Arc<SharedGroups<T>>,
    /// What its subscriptions' handles share.
    pub(crate) links: Arc<Links>,
    /// Reply topics and request deadlines (`request.rs`).
    pub(crate) requests: Requests,
    /// Set when `close` is called (`closing.rs`).
    pub(crate) closing: Closing,
    /// This bus's node id on the wire, made by its first bridge and shared
    /// by every bridge of the bus: each drops what any of them exported
    /// (a message's origin), so two bridges of one bus do not echo each
    /// other's exports back to it.
    #[cfg(feature = "bridge")]
    pub(crate) node_id: std::sync::OnceLock<String>,
}

/// Sizes of a bus's internal structures, for capacity planning and leak
/// checks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Footprint {
    /// Nodes in the subscription trie (one per distinct filter level path).
    pub trie_nodes: usize,
    /// Route-cache slots holding a route that is still current.
    pub cached_routes: usize,
    /// Slots in the route cache (its fixed size).
    pub route_cache_slots: usize,
    /// Tasks of this bus alive now (task runners and continued async
    /// deliveries).
    pub live_tasks: usize,
}

impl<T> Clone for Bus<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T: Send + Sync + 'static> Bus<T> {
    /// A bus with `config`, on the tokio runtime this is called from, if any.
    ///
    /// Errors if the configuration is invalid, or if it asks for
    /// `TaskPerSubscriber` outside a runtime.
    pub fn new(config: Config) -> Result<Self, Error> {
        Self::from_parts(config, tokio::runtime::Handle::try_current().ok())
    }

    pub(crate) fn from_parts(
        config: Config,
        handle: Option<tokio::runtime::Handle>,
    ) -> Result<Self, Error> {
        config.validate()?;
        let quiescence = Arc::new(Quiescence::new());
        let env = Arc::new(Env {
            counters: Arc::new(Counters::new()),
            quiescence: Arc::clone(&quiescence),
            workers: config.workers,
            handle,
            tasks: TaskGauge::new(config.max_inflight_tasks),
            overflow: config.overflow,
        });
        let dispatcher = Dispatcher::start(&config, &env)?;
        let trie = Arc::new(Trie::new());
        let shared = Arc::new(SharedGroups::new(config.share_policy, &env));
        let links = Arc::new(Links::new(
            quiescence,
            Arc::downgrade(&trie) as std::sync::Weak<dyn Registry>,
            Arc::downgrade(&shared) as std::sync::Weak<dyn Registry>,
        ));
        let bus = Self {
            inner: Arc::new(BusInner {
                retained: RetainedStore::new(&config),
                shared,
                links,
                requests: Requests::new(),
                closing: Closing::new(),
                policy: Policy::new(&config),
                routes: RouteCache::new(config.route_cache_capacity),
                trie,
                env,
                dispatcher,
                next_id: AtomicU64::new(1),
                config,
                #[cfg(feature = "bridge")]
                node_id: std::sync::OnceLock::new(),
            }),
        };
        bus.inner.shared.set_bus(Arc::downgrade(&bus.inner));
        Ok(bus)
    }

    /// Subscribes `handler` to topics matching `filter`.
    ///
    /// The handler runs once per matching message, where the delivery mode
    /// says (see [`DeliveryMode`](crate::DeliveryMode)); handlers make no
    /// ordering promise. Dropping the returned [`Subscription`] unsubscribes.
    /// The closure needs no type annotations. To subscribe a named type that
    /// implements [`Handler`], use [`Self::subscribe_handler`].
    ///
    /// ```
    /// use blazesub::{Bus, DeliveryMode};
    ///
    /// let bus = Bus::<String>::builder().delivery(DeliveryMode::Inline).build()?;
    /// let sub = bus.subscribe("logs/#", |m| {
    ///     tracing::info!(topic = m.topic(), line = %m.data());
    /// })?;
    /// assert!(bus.subscribe("logs/#/errors", |_| {}).is_err());
    /// # drop(sub);
    /// # Ok::<(), blazesub::Error>(())
    /// ```
    pub fn subscribe<F>(&self, filter: &str, handler: F) -> Result<Subscription, Error>
    where
        F: Fn(&Message<T>) + Send + Sync + 'static,
    {
        self.add_handler(filter, SyncSink(handler))
    }

    /// Subscribes a value of a type implementing [`Handler`] (a closure works
    /// too, but [`Self::subscribe`] infers its argument type).
    ///
    /// ```
    /// use blazesub::{Bus, DeliveryMode, Handler, Message};
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    ///
    /// struct Tally(Arc<AtomicU64>);
    /// impl Handler<u64> for Tally {
    ///     fn handle(&self, message: &Message<u64>) {
    ///         self.0.fetch_add(*message.data(), Ordering::Relaxed);
    ///     }
    /// }
    ///
    /// let bus = Bus::<u64>::builder().delivery(DeliveryMode::Inline).build()?;
    /// let total = Arc::new(AtomicU64::new(0));
    /// let _sub = bus.subscribe_handler("ticks", Tally(total.clone()))?;
    /// bus.publish("ticks", 5)?;
    /// assert_eq!(total.load(Ordering::Relaxed), 5);
    /// # Ok::<(), blazesub::Error>(())
    /// ```
    pub fn subscribe_handler<H: Handler<T>>(
        &self,
        filter: &str,
        handler: H,
    ) -> Result<Subscription, Error> {
        self.add_handler(filter, SyncSink(handler))
    }

    /// Subscribes an async handler to topics matching `filter`.
    ///
    /// The future is polled once where the delivery runs; if it is not
    /// finished, it continues as a task on the bus's runtime (within
    /// `max_inflight_tasks`), so a handler that awaits holds up nobody. Needs
    /// a runtime.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::{Bus, Message};
    /// use std::sync::Arc;
    ///
    /// let bus = Bus::<u32>::builder().build()?;
    /// let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    /// let _sub = bus.subscribe_async("jobs/#", move |m: Arc<Message<u32>>| {
    ///     let tx = tx.clone();
    ///     async move {
    ///         tokio::task::yield_now().await;
    ///         tx.send(*m.data()).unwrap();
    ///     }
    /// })?;
    /// bus.publish("jobs/7", 7)?;
    /// assert_eq!(rx.recv().await, Some(7));
    /// # Ok(()) }
    /// ```
    pub fn subscribe_async<F, Fut>(&self, filter: &str, handler: F) -> Result<Subscription, Error>
    where
        F: Fn(Arc<Message<T>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if self.inner.env.handle.is_none() {
            return Err(Error::NoRuntime {
                what: "an async handler subscription",
            });
        }
        self.add_handler(
            filter,
            AsyncSink::new(handler, self.inner.env.quiescence.id()),
        )
    }

    fn add_handler<S: Sink<T> + Tracked + 'static>(
        &self,
        filter: &str,
        sink: S,
    ) -> Result<Subscription, Error> {
        validate_filter(filter)?;
        self.check_open()?;
        let id = self.next_id();
        if split_shared(filter).is_some() {
            return self.join_group_handler(filter, id, sink);
        }
        self.insert_handler(filter, id, sink)
    }

    /// Subscribes a handler with no retained snapshot (for a bus's own
    /// subscriptions, and as the plain path).
    #[allow(dead_code)]
    pub(crate) fn insert_plain_handler<S: Sink<T> + Tracked + 'static>(
        &self,
        filter: &str,
        id: u64,
        sink: S,
    ) -> Result<Subscription, Error> {
        let mut made: Option<(Control, Arc<str>)> = None;
        self.inner
            .trie
            .insert::<Handlers>(filter, id, |filter| {
                let entry = Subscriber::new(sink);
                made = Some((entry.control(), filter));
                entry.into_handler()
            })
            .map_err(|InsertError::Closed| Error::Closed)?;
        let (control, filter) = made.expect("the trie made the entry");
        Ok(self.handle(control, id, filter, Kind::Handlers))
    }

    /// The user's handle on an entry (subscription `id`) the trie just
    /// took in.
    pub(crate) fn handle(
        &self,
        entry: Control,
        id: u64,
        filter: Arc<str>,
        kind: Kind,
    ) -> Subscription {
        let links = Arc::clone(&self.inner.links);
        Subscription::new(entry, id, filter, links, false, kind)
    }

    /// Subscribes an *ordered* handler: its calls never overlap, and each
    /// publisher's messages reach it in publish order, in every delivery
    /// mode; other subscriptions still run in parallel. A publish writes
    /// the message once to a log the filter's ordered handlers share, which
    /// keeps the newest `Config::stream_capacity` messages: a handler that
    /// falls further behind loses the oldest it had not started, counted in
    /// [`Stats::dropped`](crate::Stats). (A worker runs a burst's messages
    /// to the handler in batches of up to 64, checked against the log as
    /// the batch starts: once started, a batch runs to its end.) A slow
    /// ordered handler holds up only itself, as long as it leaves pool
    /// workers free: each delivery is a pool job, so slow ordered handlers
    /// that hold every worker fill the queue, and the `Overflow` policy
    /// then applies to the publisher as for plain handlers (under `Wait`,
    /// it waits). The log keeps its messages alive until newer ones push them
    /// out (or the filter's last ordered subscription is gone), even after
    /// every handler ran them.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::Bus;
    /// use std::sync::{Arc, Mutex};
    ///
    /// let bus = Bus::<u32>::builder().build()?; // a worker pool
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = Arc::clone(&seen);
    /// let _orders = bus.subscribe_ordered("orders/+", move |m| {
    ///     log.lock().unwrap().push(*m.data());
    /// })?;
    /// for n in 0..100 {
    ///     bus.publish("orders/eu", n)?;
    /// }
    /// bus.close().await?;
    /// assert_eq!(*seen.lock().unwrap(), (0..100).collect::<Vec<_>>());
    /// # Ok(()) }
    /// ```
    pub fn subscribe_ordered<F>(&self, filter: &str, handler: F) -> Result<Subscription, Error>
    where
        F: Fn(&Message<T>) + Send + Sync + 'static,
    {
        self.check_ordered_filter(filter)?;
        let id = self.next_id();
        // With its retained snapshot: see `retained.rs`.
        self.insert_ordered(filter, id, handler)
    }

    /// Refuses what no ordered subscription can have: an invalid filter, a
    /// shared one, a closed bus.
    fn check_ordered_filter(&self, filter: &str) -> Result<(), Error> {
        validate_filter(filter)?;
        if split_shared(filter).is_some() {
            return Err(Error::InvalidArgument {
                name: "filter",
                value: filter.to_owned(),
                reason: "is a shared subscription; ordered handlers cannot be shared (use a shared stream and read it in order)",
            });
        }
        self.check_open()
    }

    /// [`Self::subscribe_ordered`] with an async handler: each call is awaited
    /// before the next starts (on the bus's runtime, which it needs). Unlike
    /// the sync kind it queues its messages in a mailbox of
    /// `Config::stream_capacity`: a handler that falls that far behind
    /// loses the *newest* messages (refused as they come, counted in
    /// [`Stats::dropped`](crate::Stats)), not the oldest.
    pub fn subscribe_ordered_async<F, Fut>(
        &self,
        filter: &str,
        handler: F,
    ) -> Result<Subscription, Error>
    where
        F: Fn(Arc<Message<T>>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        if self.inner.env.handle.is_none() {
            return Err(Error::NoRuntime {
                what: "an async ordered subscription",
            });
        }
        let handler = move |m: Arc<Message<T>>| -> BoxFuture { Box::pin(handler(m)) };
        self.check_ordered_filter(filter)?;
        let inner = &self.inner;
        let ordered = Arc::new(Ordered::new(Box::new(handler), Arc::clone(&inner.env)));
        ordered.release_when_removed();
        let running = ordered.running();
        let consumer: Consumer = ordered;
        let id = self.next_id();
        let capacity = inner.config.stream_capacity;
        let mailbox = Mailbox::with_consumer(capacity, StreamOverflow::DropNewest, Some(consumer))
            .tracking(running);
        // With its retained snapshot: see `retained.rs`.
        self.insert_ordered_async(filter, id, mailbox)
    }

    /// Subscribes a stream to topics matching `filter`: an ordered mailbox of
    /// `Config::stream_capacity` messages, read with [`Receiver::recv`].
    ///
    /// Messages from one publisher arrive in publish order. When the mailbox
    /// is full the oldest message is dropped and counted in
    /// [`Receiver::lost`] (and reported in the stream by
    /// [`Receiver::recv_lagged`]); publishers never wait.
    pub fn subscribe_stream(&self, filter: &str) -> Result<Receiver<T>, Error> {
        self.subscribe_stream_with_capacity(filter, self.inner.config.stream_capacity)
    }

    /// [`Self::subscribe_stream`] with a mailbox of `capacity` messages.
    ///
    /// Errors: [`Error::InvalidArgument`] for a `capacity` of 0 or above
    /// [`StreamOptions::MAX_CAPACITY`], besides those of `subscribe_stream`.
    pub fn subscribe_stream_with_capacity(
        &self,
        filter: &str,
        capacity: usize,
    ) -> Result<Receiver<T>, Error> {
        self.subscribe_stream_with(filter, StreamOptions::new(capacity))
    }

    /// Subscribes a stream with its own mailbox size and overflow policy
    /// ([`StreamOverflow`]): drop the oldest (the default), drop the newest,
    /// hold publishers back (lossless), or disconnect the slow reader.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::{Bus, RecvError, StreamOptions, StreamOverflow};
    ///
    /// let bus = Bus::<u32>::builder().build()?;
    /// let mut slow = bus.subscribe_stream_with(
    ///     "ticks",
    ///     StreamOptions::new(2).overflow(StreamOverflow::Disconnect),
    /// )?;
    /// for tick in 0..3 {
    ///     bus.publish("ticks", tick)?; // the third does not fit
    /// }
    /// assert_eq!(slow.recv_lagged().await.unwrap_err(), RecvError::Lagged(1));
    /// assert_eq!(*slow.recv_lagged().await.unwrap().data(), 0);
    /// assert_eq!(*slow.recv_lagged().await.unwrap().data(), 1);
    /// assert_eq!(slow.recv_lagged().await.unwrap_err(), RecvError::Disconnected);
    /// # Ok(()) }
    /// ```
    ///
    /// Errors: [`Error::InvalidArgument`] for a capacity of 0 or above
    /// [`StreamOptions::MAX_CAPACITY`], and for a shared filter
    /// (`$share/{group}/...`) with a policy other than `DropOldest` (a
    /// group's stream members all take the default), besides those of
    /// `subscribe_stream`.
    pub fn subscribe_stream_with(
        &self,
        filter: &str,
        options: StreamOptions,
    ) -> Result<Receiver<T>, Error> {
        let capacity = options.capacity();
        let overflow = options.overflow_policy();
        validate_filter(filter)?;
        if capacity == 0 {
            return Err(Error::InvalidArgument {
                name: "capacity",
                value: capacity.to_string(),
                reason: "must be at least 1",
            });
        }
        if capacity > StreamOptions::MAX_CAPACITY {
            return Err(Error::InvalidArgument {
                name: "capacity",
                value: capacity.to_string(),
                reason: "must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
            });
        }
        self.check_open()?;
        let id = self.next_id();
        if split_shared(filter).is_some() {
            if overflow != StreamOverflow::DropOldest {
                return Err(Error::InvalidArgument {
                    name: "options",
                    value: format!("{overflow:?}"),
                    reason: "is not available to a shared stream subscription, whose members take the default policy (DropOldest)",
                });
            }
            return self.join_group_stream(filter, id, capacity);
        }
        let lossless = overflow == StreamOverflow::Backpressure;
        if lossless {
            // Counted before the entry is visible: a publish that can see it
            // also sees the count, and reserves room in it.
            self.inner.env.counters.lossless_added();
        }
        let subscribed = self.insert_stream(filter, id, capacity, overflow, true);
        if subscribed.is_err() && lossless {
            self.inner.env.counters.lossless_removed();
        }
        subscribed
    }

    /// Subscribes a stream with no retained snapshot.
    pub(crate) fn insert_plain_stream(
        &self,
        filter: &str,
        id: u64,
        capacity: usize,
        overflow: StreamOverflow,
    ) -> Result<Receiver<T>, Error> {
        let mut made = None;
        self.inner
            .trie
            .insert::<Streams>(filter, id, |filter| {
                let entry = Arc::new(StreamSubscriber::new(
                    id,
                    Mailbox::with_overflow(capacity, overflow),
                ));
                made = Some((Arc::clone(&entry), filter));
                entry
            })
            .map_err(|InsertError::Closed| Error::Closed)?;
        let (entry, filter) = made.expect("insert made the entry");
        Ok(self.receiver(entry, filter))
    }

    /// The user's receiver on a stream entry the trie just took in.
    pub(crate) fn receiver(
        &self,
        entry: crate::registry::entry::StreamEntry<T>,
        filter: Arc<str>,
    ) -> Receiver<T> {
        let subscription = self.handle(entry.control(), entry.id(), filter, Kind::Streams);
        Receiver::new(entry, Arc::clone(&self.inner.env.counters), subscription)
    }

    pub(crate) fn next_id(&self) -> u64 {
        self.inner.next_id.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn check_open(&self) -> Result<(), Error> {
        if self.inner.env.counters.is_closed() {
            return Err(Error::Closed);
        }
        Ok(())
    }

    /// Publishes `data` to `topic`; returns how many subscriptions it matched.
    ///
    /// The count is of the subscriptions the publish found as it looked: a
    /// subscription made or removed while the publish runs may be counted
    /// without receiving the message, since the two race. Subscriptions
    /// made before `publish` is called and kept until it returns are
    /// counted exactly; [`Stats`] counts what was delivered,
    /// dropped or panicked.
    ///
    /// Never waits for a lock. When the worker pool's queue for the topic is
    /// full it waits for room under `Overflow::Wait` (the default; a
    /// handler that publishes, or a bus that is closing, runs the work
    /// itself instead). In `Inline` mode, and under `Overflow::CallerRuns`
    /// when the pool or task cap is full, it runs deliveries itself before
    /// returning.
    ///
    /// Errors: [`Error::Topic`] for an invalid topic name, [`Error::Closed`]
    /// after `close`, [`Error::Full`] when a lossless
    /// ([`StreamOverflow::Backpressure`]) stream it reaches has no room (it
    /// then reaches no one), [`Error::RecursionLimit`] for a publish nested
    /// too deep in handlers' publishes run on their publisher's thread
    /// (`Inline`, or a full queue or task cap running it in place), and
    /// [`Error::Overloaded`] under `Overflow::Error` when deliveries had to
    /// be dropped.
    pub fn publish(&self, topic: &str, data: T) -> Result<usize, Error> {
        self.publish_message(topic, data, None, None)
            .map_err(|rejected| rejected.error)
    }

    /// [`Self::publish`] with [`Metadata`] attached to the message.
    pub fn publish_with(&self, topic: &str, data: T, metadata: Metadata) -> Result<usize, Error> {
        self.publish_message(topic, data, Some(metadata), None)
            .map_err(|rejected| rejected.error)
    }

    /// [`Self::publish`], but a value the bus refuses (it is closed, the
    /// topic is invalid, a lossless stream is full, or an `Inline` publish
    /// is nested too deep) is handed back in the error instead of dropped,
    /// as a channel's `send` does.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::Bus;
    ///
    /// let bus = Bus::<String>::builder().build()?;
    /// bus.close().await?;
    /// let refused = bus.try_publish("orders/1", "keep me".to_string()).unwrap_err();
    /// assert!(matches!(refused.error, blazesub::Error::Closed));
    /// assert_eq!(refused.value.as_deref(), Some("keep me"));
    /// # Ok(()) }
    /// ```
    pub fn try_publish(&self, topic: &str, data: T) -> Result<usize, Rejected<T>> {
        self.publish_message(topic, data, None, None)
    }

    /// Publishes `data` to `topic`, first waiting until every lossless
    /// ([`StreamOverflow::Backpressure`]) mailbox it reaches has room, then
    /// delivering to every subscriber at once. Without lossless subscribers
    /// it is [`Self::publish`]. It awaits only for lossless mailboxes: under
    /// `Overflow::Wait`, a full worker-pool queue (or task lane) still
    /// blocks the calling thread, as `publish` does.
    ///
    /// Cancel-safe: dropped before it completes, it has delivered nothing
    /// and holds no reserved room. Waiting publishers are served in order.
    /// A lossless mailbox whose receiver is dropped releases the publishers
    /// waiting on it at once, and `close` ends every wait with
    /// [`Error::Closed`] (a handler waiting here does not hold up the
    /// drain).
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::{Bus, StreamOptions, StreamOverflow};
    ///
    /// let bus = Bus::<u32>::builder().build()?;
    /// let mut audit = bus.subscribe_stream_with(
    ///     "audit/#",
    ///     StreamOptions::new(2).overflow(StreamOverflow::Backpressure),
    /// )?;
    /// bus.publish("audit/a", 1)?;
    /// bus.publish("audit/a", 2)?;
    /// // Full: `publish` refuses and reaches no one ...
    /// assert!(matches!(bus.publish("audit/a", 3), Err(blazesub::Error::Full { .. })));
    /// // ... `publish_async` waits for the reader.
    /// let reader = tokio::spawn(async move {
    ///     let mut seen = Vec::new();
    ///     while seen.len() < 3 {
    ///         seen.push(*audit.recv().await.unwrap().data());
    ///     }
    ///     seen
    /// });
    /// bus.publish_async("audit/a", 3).await?;
    /// assert_eq!(reader.await.unwrap(), [1, 2, 3]);
    /// # Ok(()) }
    /// ```
    pub async fn publish_async(&self, topic: &str, data: T) -> Result<usize, Error> {
        // As `publish` while there is room everywhere: nothing to wait for.
        let data = match self.publish_message(topic, data, None, None) {
            Ok(reached) => return Ok(reached),
            Err(Rejected {
                error: Error::Full { .. },
                value: Some(data),
            }) => data,
            Err(rejected) => return Err(rejected.error),
        };
        let route = self.inner.routes.route(&self.inner.trie, topic);
        // A bus closing refuses this publish anyway, and a handler waiting
        // here would keep `close` from draining: the wait ends at `close`
        // (the room it held is given back as it is dropped).
        let reservations = {
            let mut waiting = std::pin::pin!(reserve_waiting(&route));
            let mut closing = std::pin::pin!(self.inner.closing.wait());
            std::future::poll_fn(|cx| {
                if let Poll::Ready(reservations) = waiting.as_mut().poll(cx) {
                    return Poll::Ready(Ok(reservations));
                }
                match closing.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(Error::Closed)),
                    Poll::Pending => Poll::Pending,
                }
            })
            .await?
        };
        drop(route);
        self.publish_message(topic, data, None, Some(reservations))
            .map_err(|rejected| rejected.error)
    }

    /// Admits a publish to `topic`: counted as in progress (so `close`
    /// waits for it) until its guard is dropped or hands its deliveries
    /// over. Refused if the bus is closed or `topic` is not a topic name.
    pub(crate) fn admit(&self, topic: &str) -> Result<PublishGuard<'_>, Error> {
        let admitted = self.inner.env.counters.begin_publish()?;
        validate_topic(topic)?;
        Ok(admitted)
    }

    fn publish_message(
        &self,
        topic: &str,
        data: T,
        metadata: Option<Metadata>,
        reserved: Option<Reservations<T>>,
    ) -> Result<usize, Rejected<T>> {
        self.publish_nested(topic, data, metadata, reserved, true)
    }

    /// [`Self::publish_message`], checking the depth of nested in-place
    /// publishes only if `check_depth` (a reply is not checked: see
    /// [`Bus::reply`]).
    pub(crate) fn publish_nested(
        &self,
        topic: &str,
        data: T,
        metadata: Option<Metadata>,
        reserved: Option<Reservations<T>>,
        check_depth: bool,
    ) -> Result<usize, Rejected<T>> {
        let inner = &*self.inner;
        let admitted = match self.admit(topic) {
            Ok(admitted) => admitted,
            Err(error) => return Err(Rejected::with_value(error, data)),
        };
        if check_depth {
            if let Err(error) = self.check_depth(topic) {
                return Err(Rejected::with_value(error, data));
            }
        }
        let route = inner.routes.route(&inner.trie, topic);
        let reservations = match reserved {
            Some(reservations) => reservations,
            None => match self.reserve(&route, topic) {
                Ok(reservations) => reservations,
                Err(full) => return Err(Rejected::with_value(full, data)),
            },
        };
        let message = Arc::new(self.stamp(Arc::clone(&route.topic), data, metadata));
        self.fan_out(admitted, topic, route, message, Some(reservations))
    }

    /// A message this bus publishes now, from this thread: in `Inline`
    /// mode it records the depth its handlers run at (see
    /// [`Message::inline_depth`]).
    pub(crate) fn stamp(&self, topic: Arc<str>, data: T, metadata: Option<Metadata>) -> Message<T> {
        let message = Message::stamped(topic, data, metadata);
        if self.inner.policy.is_inline() {
            message.at_inline_depth(next_inline_depth())
        } else {
            message
        }
    }

    /// Refuses a publish nested [`MAX_INLINE_DEPTH`] deep in handlers'
    /// publishes run on their publisher's thread (counted), before it
    /// recurses any further: every `Inline` publish, and in the other modes
    /// one its publisher ran itself (a full queue or task cap). A publish
    /// that is queued runs at depth 0 wherever it runs.
    #[inline]
    pub(crate) fn check_depth(&self, topic: &str) -> Result<(), Error> {
        if inline_depth() >= MAX_INLINE_DEPTH {
            self.inner.env.counters.recursion_refused();
            return Err(Error::RecursionLimit {
                topic: topic.to_owned(),
                depth: inline_depth(),
            });
        }
        Ok(())
    }

    /// Room in every lossless mailbox `route` reaches, taken now without
    /// waiting ([`reserve_now`]); `Error::Full` if one has none.
    pub(crate) fn reserve(&self, route: &Route<T>, topic: &str) -> Result<Reservations<T>, Error> {
        if !self.inner.env.counters.has_lossless_streams() {
            return Ok(Reservations::none());
        }
        reserve_now(route).map_err(|NoRoom { capacity }| Error::Full {
            topic: topic.to_owned(),
            capacity,
        })
    }

    /// Delivers a message that came in through a bridge to the
    /// subscriptions whose filter is exactly `filter` (none of the others,
    /// and no shared group): a bridge receives one copy per upstream
    /// subscription, so with overlapping filters (`a/#`, `a/+`) each copy
    /// goes to its own filter's subscribers, and every subscriber gets the
    /// message once. The message is marked imported, so no bridge's export
    /// tap sends it out again. Returns how many subscriptions it reached.
    #[cfg(any(feature = "nats", feature = "mqtt"))]
    pub(crate) fn deliver_imported(
        &self,
        filter: &str,
        topic: &str,
        data: T,
        metadata: Option<Metadata>,
    ) -> Result<usize, Error> {
        let inner = &*self.inner;
        let admitted = self.admit(topic)?;
        let Some(node) = inner.trie.exact(filter) else {
            return Ok(0);
        };
        let route = Arc::new(Route::single(Arc::from(topic), node));
        let message = Message::stamped(Arc::clone(&route.topic), data, metadata).imported();
        self.fan_out_to(admitted, topic, route, Arc::new(message), None, false)
            .map_err(|rejected| rejected.error)
    }

    /// A hidden stream subscription on `filter` for a bridge's exports: it
    /// is not interest (no bridge subscribes upstream for it) and is not
    /// counted in [`Self::subscriptions_count`]. Drops the oldest message
    /// when full; its `lost()` counts only the dropped messages `owns`
    /// accepts (the ones this tap would have sent).
    #[cfg(any(feature = "nats", feature = "mqtt"))]
    pub(crate) fn subscribe_tap(
        &self,
        filter: &str,
        capacity: usize,
        owns: crate::registry::mailbox::Owns<T>,
    ) -> Result<Receiver<T>, Error> {
        validate_filter(filter)?;
        self.check_open()?;
        let id = self.next_id();
        let mut made = None;
        self.inner
            .trie
            .insert_tap(filter, id, |filter| {
                let entry = Arc::new(StreamSubscriber::new(
                    id,
                    Mailbox::with_overflow(capacity.max(1), StreamOverflow::DropOldest)
                        .owning(owns),
                ));
                made = Some((Arc::clone(&entry), filter));
                entry
            })
            .map_err(|InsertError::Closed| Error::Closed)?;
        let (entry, filter) = made.expect("insert made the entry");
        let subscription = self.handle(entry.control(), id, filter, Kind::Tap);
        Ok(Receiver::new(
            entry,
            Arc::clone(&self.inner.env.counters),
            subscription,
        ))
    }

    /// The second half of a publish: `message` (to `route`'s topic) goes to
    /// every stream, handler and shared group the route reaches.
    pub(crate) fn fan_out(
        &self,
        admitted: PublishGuard<'_>,
        topic: &str,
        route: Arc<Route<T>>,
        message: Arc<Message<T>>,
        reserved: Option<Reservations<T>>,
    ) -> Result<usize, Rejected<T>> {
        self.fan_out_to(admitted, topic, route, message, reserved, true)
    }

    /// [`Self::fan_out`], reaching shared groups only if `shared`.
    #[inline]
    fn fan_out_to(
        &self,
        mut admitted: PublishGuard<'_>,
        topic: &str,
        route: Arc<Route<T>>,
        message: Arc<Message<T>>,
        reserved: Option<Reservations<T>>,
        shared: bool,
    ) -> Result<usize, Rejected<T>> {
        let inner = &*self.inner;
        let counters = &inner.env.counters;
        // Callers that made the message before reserving (retained
        // publishes, requests) reserve here; a refusal cannot hand the value
        // back then.
        let mut reservations = match reserved {
            Some(reservations) => reservations,
            None => self
                .reserve(&route, topic)
                .map_err(|error| Rejected { error, value: None })?,
        };
        counters.published();
        // Reservations imply streams, so only a bus that never had one
        // skips looking (a set read per node of the route).
        let mut matched = if inner.trie.had_streams() {
            push_to_streams(&route, &message, counters, &mut admitted, &mut reservations)
        } else {
            0
        };
        let mut positions = Positions::new();
        let mut sets = route.handler_sets_appending(&message, &mut positions);
        matched += sets.iter().map(|set| set.live()).sum::<usize>();
        if shared {
            matched += inner.shared.route(&message, &mut sets, counters);
        }
        let job = Fanout::new(message, sets, positions, &inner.policy).map(|job| {
            let place = inner.dispatcher.place(&job, &route.home);
            job.at_place(place)
        });
        drop(route);
        if let Some(job) = job {
            admitted.accept(job.total());
            let dropped = inner.dispatcher.dispatch(job, &inner.env);
            if dropped > 0 && inner.config.overflow == Overflow::Error {
                return Err(Rejected {
                    error: Error::Overloaded {
                        topic: topic.to_owned(),
                        dropped,
                        matched,
                    },
                    value: None,
                });
            }
        }
        Ok(matched)
    }

    /// Delivers `message` to the handlers of `set` as a job of its own (a
    /// message a shared group's leaving stream member handed to a handler
    /// member): admitted and run as a publish's deliveries are. `false` if
    /// it was dropped (counted) instead: on a bus already closing, or by
    /// the overflow policy as it was handed to a runner.
    pub(crate) fn dispatch_to(&self, message: Arc<Message<T>>, set: Arc<HandlerSet<T>>) -> bool {
        let inner = &*self.inner;
        let Ok(mut admitted) = inner.env.counters.begin_publish() else {
            inner.env.counters.dropped_now(1);
            return false;
        };
        let sets: HandlerSets<T> = std::iter::once(set).collect();
        let Some(job) = Fanout::new(message, sets, Positions::new(), &inner.policy) else {
            return true;
        };
        admitted.accept(job.total());
        inner.dispatcher.dispatch(job, &inner.env) == 0
    }

    /// Whether a publish to `topic` would reach anyone now: skip building an
    /// expensive message nobody reads. Answered from the route cache (no
    /// lock, no allocation once the topic's route is cached). `false` for an
    /// invalid topic name, which no publish could use.
    ///
    /// ```
    /// use blazesub::{Bus, DeliveryMode};
    ///
    /// let bus = Bus::<String>::builder().delivery(DeliveryMode::Inline).build()?;
    /// assert!(!bus.has_subscribers("reports/daily"));
    /// let _sub = bus.subscribe("reports/+", |_| {})?;
    /// if bus.has_subscribers("reports/daily") {
    ///     bus.publish("reports/daily", "an expensive report".to_string())?;
    /// }
    /// assert_eq!(bus.subscribers("reports/daily"), 1);
    /// # Ok::<(), blazesub::Error>(())
    /// ```
    #[inline]
    pub fn has_subscribers(&self, topic: &str) -> bool {
        self.subscribers(topic) > 0
    }

    /// How many subscriptions a publish to `topic` would reach now (0 for an
    /// invalid topic name), as `publish` counts them: a shared group
    /// (`$share/{group}/{filter}`) with a member counts once. Like
    /// [`Self::has_subscribers`], a route-cache read (and, on a bus with
    /// shared groups, a look at each group's filter).
    ///
    /// One difference: a [`StreamOverflow::Disconnect`] stream that has
    /// disconnected is counted here until its [`Receiver`] is dropped,
    /// while `publish` already skips it (and does not count it).
    pub fn subscribers(&self, topic: &str) -> usize {
        if validate_topic(topic).is_err() {
            return 0;
        }
        self.inner.routes.subscribers(&self.inner.trie, topic) + self.inner.shared.reached(topic)
    }

    /// Live subscriptions (handlers and streams).
    pub fn subscriptions_count(&self) -> u64 {
        self.inner.trie.subscriptions() + self.inner.shared.members()
    }

    /// Deliveries accepted but not finished: queued, running, or async ones
    /// still awaiting.
    pub fn inflight_messages(&self) -> u64 {
        self.inner.env.counters.inflight()
    }

    /// A snapshot of the bus's counters.
    pub fn stats(&self) -> Stats {
        // First: it removes (and counts) what has expired.
        let retained = self.inner.retained.len(&self.inner.env.counters) as u64;
        let mut stats = self.inner.env.counters.snapshot();
        stats.subscriptions = self.subscriptions_count();
        stats.retained = retained;
        stats
    }

    /// Sizes of the bus's internal structures. It reads every route-cache
    /// slot (4,096 by default), so it is for monitoring, not for hot loops.
    pub fn footprint(&self) -> Footprint {
        let inner = &self.inner;
        Footprint {
            trie_nodes: inner.trie.node_count(),
            cached_routes: inner.routes.current_entries(&inner.trie),
            route_cache_slots: inner.routes.capacity(),
            live_tasks: inner.env.tasks.live(),
        }
    }

    /// The configuration the bus was built with.
    pub fn config(&self) -> &Config {
        &self.inner.config
    }

    /// Whether [`Self::close`] has been called.
    pub fn is_closed(&self) -> bool {
        self.inner.env.counters.is_closed()
    }

    /// Closes the bus: refuses new publishes and subscriptions from now on
    /// ([`Error::Closed`]), waits until every accepted delivery has finished,
    /// then ends the stream receivers (after they drain) and stops the worker
    /// pool. Gives up waiting after `Config::close_timeout` with
    /// [`Error::CloseTimeout`]; the bus stays closed and the remaining
    /// deliveries still run.
    ///
    /// Called from inside a handler (an async handler awaiting it, or a sync
    /// one blocking on it where it may block: a pool worker, or a publisher's
    /// thread that is not a tokio worker; on a tokio worker, where
    /// `TaskPerSubscriber` runs its handlers, a sync handler spawns the
    /// close instead), it finishes once everything
    /// else has drained: it does not wait for its own caller. A sync handler
    /// blocking on it holds up the publish it runs in, which is not waited
    /// for either; what is queued behind that publish on a pool worker no
    /// other worker takes (a pool of one) runs meanwhile on a thread of the
    /// close's own, which stands in for the held-up worker (one per pool at
    /// a time). An async handler awaiting it holds up only its own
    /// delivery (the rest of its publish goes on, and is waited for), and,
    /// for an ordered handler, the messages queued behind that call, which
    /// run once it has returned. Deliveries of other buses are none of this
    /// bus's: a handler of one bus closing another waits for all of the
    /// other's.
    ///
    /// Cancel-safe: the bus is closed when this is called (before the
    /// future is first polled, even if it never is), and
    /// ending the streams and stopping the workers does not depend on this
    /// future (the thread it waits on, so that no executor thread blocks,
    /// stops waiting when it is dropped). They happen when the last
    /// accepted delivery finishes, by whoever finishes it, even if the
    /// future is dropped (a `timeout`, a `select!`) or has returned
    /// `CloseTimeout`.
    ///
    /// Works on any executor; calling it again waits again.
    pub fn close(&self) -> impl Future<Output = Result<(), Error>> + Send + 'static {
        let inner = Arc::clone(&self.inner);
        inner.dispatcher.closing();
        // No reply can come any more, and no publish can be accepted:
        // waiting requests and publishers end now.
        inner.closing.start();
        let closing = Arc::downgrade(&self.inner);
        inner.env.counters.close(move || {
            if let Some(inner) = closing.upgrade() {
                inner.finish_close();
            }
        });
        async move {
            // What the stack that first polls this holds, if it is inside a
            // handler: it is not waited for (it cannot finish first).
            // Looked at there, not where `close` was called: a future
            // handed to another task or thread waits for everything.
            // Counted for this bus only (a handler of another bus is
            // waited for like anything else).
            let own_tokens = crate::stats::tokens_here(&inner.env.counters);
            let caller = quiesce::caller_here(&inner.env.quiescence);
            Self::wait_closed(inner, own_tokens, caller).await
        }
    }

    /// The waiting half of [`Self::close`]: until everything accepted has
    /// finished but what the caller's own stack holds.
    async fn wait_closed(
        inner: Arc<BusInner<T>>,
        own_tokens: u64,
        caller: quiesce::Caller,
    ) -> Result<(), Error> {
        let from_handler = own_tokens > 0 || caller.holds_any();
        if !from_handler && inner.env.counters.wait_drained(Duration::ZERO).is_ok() {
            return Ok(());
        }
        // Wait on a thread of our own, so no executor thread blocks. The
        // thread gives up when this future is dropped.
        let abandoned = Abandoned::new(&inner.env.counters);
        let flag = Arc::clone(&abandoned.flag);
        let (done, waited) = tokio::sync::oneshot::channel();
        let waiter = Arc::clone(&inner);
        std::thread::Builder::new()
            .name("blazesub-close".into())
            .spawn(move || {
                let timeout = waiter.config.close_timeout;
                let counters = &waiter.env.counters;
                if !from_handler {
                    let _ = done.send(counters.wait_drained_unless(timeout, &flag));
                    return;
                }
                let stop = std::sync::atomic::AtomicBool::new(false);
                std::thread::scope(|scope| {
                    // The caller may hold up a pool worker with work queued
                    // behind it: a thread of its own runs that work if
                    // nobody else can. Not this one: a handler it runs may
                    // block, and this one must give up at the timeout.
                    if let Some(mut stand_in) = waiter.dispatcher.stand_in(&waiter.env) {
                        let stop = &stop;
                        let spawned = std::thread::Builder::new()
                            .name("blazesub-close-stand-in".into())
                            .spawn_scoped(scope, move || {
                                while !stop.load(std::sync::atomic::Ordering::Acquire) {
                                    if !stand_in() {
                                        std::thread::sleep(Duration::from_millis(1));
                                    }
                                }
                            });
                        if let Err(error) = spawned {
                            tracing::warn!(%error, "close: no thread to run held-up work");
                        }
                    }
                    let result =
                        counters.wait_drained_except(|| caller.own_now(own_tokens), timeout, &flag);
                    stop.store(true, std::sync::atomic::Ordering::Release);
                    // Before the scope waits for the stand-in, which may be
                    // in a handler that blocks.
                    let _ = done.send(result);
                });
            })
            .map_err(Error::Spawn)?;
        let result = waited.await.unwrap_or(Err(Error::Closed));
        drop(abandoned);
        result
    }
}

/// Set when a `close` future is dropped (or done), so the thread it waits
/// on stops waiting: a `close` in a `select!` loop or retried under a
/// timeout leaves no thread behind. (Except a pool's one stand-in, while
/// a handler it took blocks, and the thread that joins it: see
/// `Pool::stand_in`.)
struct Abandoned {
    flag: Arc<std::sync::atomic::AtomicBool>,
    counters: Arc<Counters>,
}

impl Abandoned {
    fn new(counters: &Arc<Counters>) -> Self {
        Self {
            flag: Arc::default(),
            counters: Arc::clone(counters),
        }
    }
}

impl Drop for Abandoned {
    fn drop(&mut self) {
        self.flag.store(true, std::sync::atomic::Ordering::Release);
        self.counters.wake_waiters();
    }
}

impl<T: Send + Sync + 'static> BusInner<T> {
    /// The end of closing, once everything accepted has finished: no more
    /// work can arrive, so the streams end and the workers stop with nothing
    /// queued. Idempotent.
    fn finish_close(&self) {
        self.trie.close_streams();
        self.shared.close_streams();
        self.dispatcher.shut_down();
    }
}

impl<T: 'static> fmt::Debug for Bus<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let counters = &self.inner.env.counters;
        f.debug_struct("Bus")
            .field("delivery", &self.inner.config.delivery)
            .field(
                "subscriptions",
                &(self.inner.trie.subscriptions() + self.inner.shared.members()),
            )
            .field("inflight", &counters.inflight())
            .field("closed", &counters.is_closed())
            .finish()
    }
}
