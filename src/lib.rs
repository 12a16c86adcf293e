//! blazesub: an in-process publish/subscribe bus for async Rust services.
//!
//! MQTT-style topics with `+` and `#` wildcards, fan-out to thousands or
//! millions of subscribers, three delivery modes, and a threshold that
//! decides how a publish fans out — with no performance cliff and nothing
//! lost without a count.
//!
//! ```
//! # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
//! use blazesub::{Bus, Message};
//! use std::sync::Arc;
//!
//! #[derive(Debug)]
//! struct Reading { celsius: f32 }
//!
//! let bus: Bus<Reading> = Bus::builder().build()?;
//!
//! // A handler subscription: runs on the bus's worker pool.
//! bus.subscribe("sensors/+/temp", |m: &Message<Reading>| {
//!     tracing::info!(topic = m.topic(), celsius = m.data().celsius);
//! })?
//! .detach();
//!
//! // A stream subscription: an ordered, bounded mailbox.
//! let mut alerts = bus.subscribe_stream("sensors/#")?;
//!
//! bus.publish("sensors/kitchen/temp", Reading { celsius: 21.5 })?;
//! let first: Arc<Message<Reading>> = alerts.recv().await.unwrap();
//! assert_eq!(first.topic(), "sensors/kitchen/temp");
//!
//! bus.close().await?;
//! # Ok(()) }
//! ```
//!
//! # Delivery modes and the threshold
//! A publish that matches `n` handler subscriptions, with threshold
//! `T = max_concurrent_subscriptions` (default 10), gives each subscription
//! its own unit of work when `n <= T`, and batches them when `n > T`: into
//! about one chunk per worker ([`Batch::Chunked`], the default) or into one
//! batch for all ([`Batch::Single`], BlazeSub's policy, with its cliff).
//! Units run on a bounded worker pool ([`DeliveryMode::WorkerPool`], the
//! default), as tokio tasks ([`DeliveryMode::TaskPerSubscriber`]) or on the
//! publisher's thread ([`DeliveryMode::Inline`]). In the pool, every topic
//! has a home worker (topics get them in turn, and a topic whose worker
//! another busy topic keeps busy moves to an idle one) and its publishes
//! run there,
//! one after another, so its handlers' state stays in one core's cache and
//! handlers that share state never fight over it between cores; two busy
//! topics run on two workers (on Linux, a busy worker that finds another on
//! its CPU moves itself to a free one: see [`Config::workers`]). An idle
//! worker helps a publish that has
//! nothing queued behind it, and takes over from a worker stalled in a slow
//! handler. When a pool queue or the task cap is full, [`Overflow`] decides:
//! the publisher waits for room (`Wait`, the default), runs the work itself
//! (`CallerRuns`), or it is dropped and counted (`Drop`, `Error`).
//!
//! # Delivery
//! - A subscription that exists for the whole of a `publish` call, and is
//!   still subscribed when its delivery starts, receives that message exactly
//!   once, unless a policy you chose dropped it — then it is counted in
//!   [`Stats::dropped`]. Nothing accepted disappears uncounted, not even when
//!   the runtime a `TaskPerSubscriber` bus runs on shuts down: its deliveries
//!   are counted as dropped and [`Bus::inflight_messages`] returns to 0.
//! - A stream subscription receives one publisher's messages in publish order
//!   (a shared group's stream member also gets, after what it holds, what a
//!   member that left had queued); handler subscriptions make no ordering
//!   promise (two calls of one handler may run at once on different workers).
//! - A panicking handler is caught and counted; nobody else notices.
//! - Every queue is bounded; one publish allocates O(1) whatever the number
//!   of subscribers (a publish that reaches more than four shared groups'
//!   handler members grows one list, by doubling: O(log n) allocations).
//! - A publish the bus refuses (closed, invalid topic) is an error; with
//!   [`Bus::try_publish`] the value comes back in it ([`Rejected`]).
//! - Topics follow MQTT 3.1.1/5.0 section 4.7; see [`topic`].
//!
//! # Unsubscribing
//! Dropping a [`Subscription`] (or [`Receiver`]) or calling
//! [`Subscription::unsubscribe`] removes it. When that returns, no delivery
//! to it that had not yet *started* will run, queued ones included. A
//! delivery starts when it checks the subscription's flag, just before the
//! handler is called, so a call that started on another thread may still be
//! running — or about to enter the handler — when `unsubscribe` returns:
//! unsubscribing does not wait, so that a handler can unsubscribe itself.
//! [`Subscription::unsubscribe_and_wait`] does wait: it returns once no call
//! of that handler is running (a handler awaiting its own unsubscribe does
//! not wait for itself).
//!
//! Once the calls that had started have finished, the handler closure is
//! dropped, as closing a tokio channel drops what it owned: a `Sender` it
//! captured closes its channel, a `Bus` clone it captured makes no cycle
//! (but a *detached* handler that owns a `Bus` clone is never unsubscribed:
//! the bus then owns itself, and lives on, closed or not, until the process
//! ends; give such a handler a [`WeakBus`] ([`Bus::downgrade`]) instead, or
//! keep its `Subscription`). In
//! a handler set larger than 64 subscriptions on one filter, the release
//! waits for that set's next compaction (once half of it is dead);
//! `unsubscribe_and_wait` compacts at once. Dropping anything from inside a
//! handler — another `Subscription`, a `Receiver`, the bus — is safe: the bus
//! never runs user `Drop` code while it holds a lock.
//!
//! # Delivery contracts
//! Each subscription chooses its contract (see `docs/contracts.md` for what
//! each costs):
//!
//! | subscription | ordered? | lossy or lossless | when it is full, the publisher… |
//! |---|---|---|---|
//! | [`Bus::subscribe`] (handler) | no | lossless unless `Overflow::Drop`/`Error` | waits for room (`Wait`, the default), runs the work itself (`CallerRuns`), or drops and counts it |
//! | [`Bus::subscribe_ordered`] (handler) | yes: no overlap, each publisher's order | a handler `stream_capacity` messages behind loses the oldest, counted (async: the newest) | never waits for the handler's log; but each delivery is a job of the pool like a plain handler's, so when slow ordered handlers hold every worker and the queue fills, the `Overflow` policy applies as above |
//! | stream, [`StreamOverflow::DropOldest`] (default) | each publisher's order | lossy: the oldest goes, counted | never waits |
//! | stream, [`StreamOverflow::DropNewest`] | each publisher's order | lossy: the newest goes, counted | never waits |
//! | stream, [`StreamOverflow::Backpressure`] | each publisher's order | lossless | `publish`: [`Error::Full`], reaching no one; [`Bus::publish_async`]: waits for room |
//! | stream, [`StreamOverflow::Disconnect`] | each publisher's order | the stream ends at its first overflow | never waits |
//!
//! Handlers may act on the bus: `publish`, `publish_async`, `subscribe`,
//! unsubscribing and `close` from inside a handler never deadlock (`close`
//! then waits for everything but its own caller). A handler whose publishes
//! reach itself again on one thread's stack (every publish in `Inline`
//! mode; in the others, one its publisher runs itself because a queue or
//! the task cap is full) is stopped at 64 nested publishes with
//! [`Error::RecursionLimit`] (counted), never a stack overflow.
//! [`Bus::has_subscribers`] tells a publisher whether anyone listens.
//!
//! # Closing
//! [`Bus::close`] refuses new publishes and subscriptions at once
//! ([`Error::Closed`]), waits for every accepted delivery to finish, then
//! ends the streams (each reader still drains what it holds) and stops the
//! workers. It gives up waiting after `Config::close_timeout`
//! ([`Error::CloseTimeout`]), but the bus stays closed and the rest still
//! happens: the streams end and the workers stop when the last accepted
//! delivery finishes, whoever finishes it. So `close` is cancel-safe:
//! dropping its future (`tokio::time::timeout`, `select!`) changes nothing
//! but the waiting.
//!
//! # Lagging
//! A stream subscription by default never holds up a publisher: when its
//! mailbox is full, the oldest message makes room for the newest and is
//! counted in [`Receiver::lost`] and [`Stats::dropped`] (the other
//! policies, lossless `Backpressure` among them, are chosen per
//! subscription with [`StreamOptions`]). `recv` and the `Stream`
//! implementation read on across the gap. A reader that wants to know where
//! it fell behind reads with [`Receiver::recv_lagged`] instead, which returns
//! [`RecvError::Lagged(n)`](RecvError::Lagged) once, just before the first
//! message after `n` lost ones (as tokio's broadcast channel does), and
//! [`RecvError::Closed`] at the end.
//!
//! ```
//! # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
//! use blazesub::{Bus, RecvError};
//!
//! let bus: Bus<u32> = Bus::builder().build()?;
//! let mut prices = bus.subscribe_stream_with_capacity("prices/#", 3)?;
//! for cents in 100..108 {
//!     bus.publish("prices/eur", cents)?; // 8 into a mailbox of 3
//! }
//!
//! assert_eq!(prices.recv_lagged().await.unwrap_err(), RecvError::Lagged(5));
//! assert_eq!(*prices.recv_lagged().await.unwrap().data(), 105);
//! assert_eq!(*prices.recv().await.unwrap().data(), 106);
//! # Ok(()) }
//! ```

//!
//! # Retained messages
//! [`Bus::publish_retained`] publishes and keeps the message as its topic's
//! current value (MQTT's retain flag). A subscription made later (handler
//! or stream, not shared) receives the retained messages its filter matches
//! first, marked [`Message::is_retained`], then every later publish: per
//! topic no gap and no duplicate, even while publishers race the subscribe.
//! The store holds at most [`Config::max_retained`] topics (the least
//! recently retained is evicted) and may expire messages
//! ([`Config::retained_expiry`]); both are counted in [`Stats`]. A subscribe
//! costs what its filter matches, not what is stored.
//!
//! ```
//! # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
//! use blazesub::Bus;
//!
//! let bus = Bus::<u32>::builder().build()?;
//! bus.publish_retained("flags/new-checkout", 1)?;
//! let mut flags = bus.subscribe_stream("flags/#")?; // joins late
//! let current = flags.recv().await.unwrap();
//! assert_eq!((*current.data(), current.is_retained()), (1, true));
//! # Ok(()) }
//! ```
//!
//! # Shared subscriptions
//! A filter `$share/{group}/{filter}` (MQTT 5) joins a group: each matching
//! publish goes to exactly one member, picked by [`SharePolicy`] (least
//! loaded by default; round robin; or by topic hash, which keeps per-topic
//! order for stream members and, on an `Inline` bus, handler members). A member that leaves passes on what was picked or queued for it;
//! with no member left it is counted as dropped. A work queue, in one line
//! per worker:
//!
//! ```
//! use blazesub::{Bus, DeliveryMode};
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//!
//! let bus = Bus::<u32>::builder().delivery(DeliveryMode::Inline).build()?;
//! let done = Arc::new(AtomicU32::new(0));
//! let workers: Vec<_> = (0..3)
//!     .map(|_| {
//!         let done = Arc::clone(&done);
//!         bus.subscribe("$share/workers/jobs/#", move |_| {
//!             done.fetch_add(1, Ordering::Relaxed);
//!         })
//!     })
//!     .collect::<Result<_, _>>()?;
//! for job in 0..30 {
//!     assert_eq!(bus.publish("jobs/resize", job)?, 1); // one member, counted once
//! }
//! assert_eq!(done.load(Ordering::Relaxed), 30);
//! # drop(workers);
//! # Ok::<(), blazesub::Error>(())
//! ```
//!
//! # Request/reply
//! [`Bus::request`] publishes a message carrying a reply topic
//! ([`Message::reply_to`], a `$reply/...` topic of its own, so `#` never sees
//! replies) and waits for the first [`Bus::reply`]; [`Bus::request_many`]
//! gathers several, and accepts a filter to ask every service it overlaps.
//! Nobody subscribed is [`Error::NoResponders`] at once; no reply in time is
//! [`Error::Timeout`] (the bus keeps its own deadlines: no tokio timer
//! needed). The reply subscription is removed however the request ends,
//! including when its future is dropped. A request to a shared subscription
//! goes to one member: a load-balanced service. See [`Bus::request`] for an
//! example.
//!
//! # Many processes: the bridge (features `nats`, `mqtt`)
//! `blazesub::bridge::Bridge` joins the buses of many processes or machines
//! through a NATS server or an MQTT 5 broker: local publishes matching its export filters go
//! out, remote ones matching its import filters come in, with one upstream
//! subscription per distinct local filter, exactly one delivery per
//! subscriber, and no loops. At most once (at least once over MQTT, as an
//! option); every loss counted. See the
//! `bridge` module (built with `--features nats` or `mqtt`) and `docs/bridge.md`.

// `unsafe` only where a benchmark showed it pays, each use allowed where it
// is and its soundness argued there: `registry/write_once.rs` (with the
// calls in `registry/subset.rs` and `registry/trie.rs` that keep its
// contract).
#![deny(unsafe_code)]

#[cfg(any(feature = "nats", feature = "mqtt"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "nats", feature = "mqtt"))))]
pub mod bridge;
mod builder;
mod bus;
mod closing;
mod config;
mod dispatch;
mod error;
mod handler;
mod handles;
mod message;
mod panic_message;
mod registry;
mod request;
mod reserve;
mod retained;
mod shared;
mod stats;
mod stream_options;
mod sync;
pub mod topic;
mod weak_bus;

#[cfg(all(test, loom))]
mod loom_tests;

/// The README's example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

/// `docs/contracts.md`'s program choosing a delivery contract, compiled and
/// run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../docs/contracts.md")]
struct ContractsDoctest;

pub use builder::BusBuilder;
pub use bus::{Bus, ByteBus, Footprint};
pub use config::{Batch, Config, DeliveryMode, Overflow, SharePolicy};
pub use error::{Error, Rejected};
pub use handler::Handler;
pub use handles::Subscription;
pub use handles::{Receiver, RecvError, TryRecvError, TryRecvLaggedError};
pub use message::{Message, Metadata};
pub use stats::Stats;
pub use stream_options::{StreamOptions, StreamOverflow};
pub use weak_bus::WeakBus;
