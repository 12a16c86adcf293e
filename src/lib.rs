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
//! publisher's thread ([`DeliveryMode::Inline`]). When the pool's queue or the
//! task cap is full, [`Overflow`] decides: the publisher runs the work itself
//! (`CallerRuns`, the default), or it is dropped and counted (`Drop`,
//! `Error`).
//!
//! # Guarantees
//! - A subscription that exists for the whole of a `publish` call, and is
//!   still subscribed when its delivery starts, receives that message exactly
//!   once, unless a policy you chose dropped it — then it is counted in
//!   [`Stats::dropped`].
//! - After `unsubscribe` (or drop) returns, no delivery to that subscription
//!   that had not started will run, queued ones included.
//! - A stream subscription receives one publisher's messages in publish order;
//!   handler subscriptions make no ordering promise.
//! - A panicking handler is caught and counted; nobody else notices.
//! - Every queue is bounded; one publish allocates O(1) whatever the number
//!   of subscribers.
//! - Topics follow MQTT 3.1.1/5.0 section 4.7; see [`topic`].
//!
//! # Lagging
//! A stream subscription never holds up a publisher: when its mailbox is
//! full, the oldest message makes room for the newest and is counted in
//! [`Receiver::lost`] and [`Stats::dropped`]. `recv` and the `Stream`
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

#![forbid(unsafe_code)]

mod builder;
mod bus;
mod config;
mod dispatch;
mod error;
mod handler;
mod handles;
mod message;
mod registry;
mod stats;
mod sync;
pub mod topic;

#[cfg(all(test, loom))]
mod loom_tests;

/// The README's example, compiled and run as a doc test.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctest;

pub use builder::BusBuilder;
pub use bus::{Bus, ByteBus, Footprint};
pub use config::{Batch, Config, DeliveryMode, Overflow};
pub use error::Error;
pub use handler::Handler;
pub use handles::Subscription;
pub use handles::{Receiver, RecvError, TryRecvError, TryRecvLaggedError};
pub use message::{Message, Metadata};
pub use stats::Stats;
