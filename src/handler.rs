//! The [`Handler`] trait: what a handler subscription calls.

use crate::message::Message;

/// Something that handles messages: any `Fn(&Message<T>) + Send + Sync +
/// 'static` closure is one.
///
/// ```
/// use blazesub::{Bus, Handler, Message};
/// use std::sync::atomic::{AtomicU64, Ordering};
///
/// struct Counter(AtomicU64);
///
/// impl Handler<u32> for Counter {
///     fn handle(&self, message: &Message<u32>) {
///         self.0.fetch_add(u64::from(*message.data()), Ordering::Relaxed);
///     }
/// }
///
/// let bus = Bus::<u32>::builder().delivery(blazesub::DeliveryMode::Inline).build()?;
/// let counter = std::sync::Arc::new(Counter(AtomicU64::new(0)));
/// let _sub = bus.subscribe_handler("ticks", SharedCounter(counter.clone()))?;
/// bus.publish("ticks", 5)?;
/// assert_eq!(counter.0.load(Ordering::Relaxed), 5);
///
/// // A handler can also be shared through an Arc.
/// struct SharedCounter(std::sync::Arc<Counter>);
/// impl Handler<u32> for SharedCounter {
///     fn handle(&self, message: &Message<u32>) { self.0.handle(message) }
/// }
/// # Ok::<(), blazesub::Error>(())
/// ```
pub trait Handler<T>: Send + Sync + 'static {
    /// Handles one message.
    fn handle(&self, message: &Message<T>);
}

impl<T, F> Handler<T> for F
where
    F: Fn(&Message<T>) + Send + Sync + 'static,
{
    #[inline]
    fn handle(&self, message: &Message<T>) {
        self(message)
    }
}
