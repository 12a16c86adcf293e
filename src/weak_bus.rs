//! [`WeakBus`]: a handle to a bus that does not keep it alive.
//!
//! # Contract
//! - [`Bus::downgrade`] makes one; [`WeakBus::upgrade`] gives a [`Bus`]
//!   while any `Bus` handle (or a running publish, or a bridge) still holds
//!   the bus, and `None` once the last one has gone. It is `std::sync::Weak`
//!   under the bus's handle, with the same cost: one compare-and-swap per
//!   upgrade.
//! - It is what a handler that acts on its own bus should own. A handler
//!   owns its captures until it is unsubscribed, so a `Bus` clone in a
//!   **detached** handler makes the bus own itself: it is never dropped,
//!   closed or not. A `WeakBus` there lets the bus go when the service's
//!   last `Bus` does (the handler's closure goes with it).
//! - A `Bus` upgraded inside a handler and dropped there is the last handle
//!   if the service's own went meanwhile: dropping the bus from inside a
//!   handler is safe (see the crate docs).

use std::fmt;
use std::sync::{Arc, Weak};

use crate::bus::{Bus, BusInner};

/// A handle to a [`Bus`] that does not keep it alive; see
/// [`Bus::downgrade`].
///
/// ```
/// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
/// use blazesub::Bus;
///
/// let bus = Bus::<String>::builder().build()?;
/// let weak = bus.downgrade();
/// // A responder that lives as long as the bus, and does not keep it alive.
/// bus.subscribe("time/request", move |m| {
///     if let Some(bus) = weak.upgrade() {
///         let _ = bus.reply(m, "noon".to_string());
///     }
/// })?
/// .detach();
///
/// let reply = bus
///     .request("time/request", String::new(), std::time::Duration::from_secs(1))
///     .await?;
/// assert_eq!(reply.data(), "noon");
/// // The reply can arrive before the responder's call has returned (and
/// // dropped the `Bus` it upgraded); `close` waits for that call.
/// bus.close().await?;
/// let weak = bus.downgrade();
/// drop(bus); // the last `Bus`: the bus goes, its detached handler with it
/// assert!(weak.upgrade().is_none());
/// # Ok(()) }
/// ```
pub struct WeakBus<T> {
    inner: Weak<BusInner<T>>,
}

impl<T> WeakBus<T> {
    /// The bus, if any `Bus` handle still holds it; `None` once the last
    /// one is gone. A closed bus that is still held upgrades (its calls
    /// then return [`Error::Closed`](crate::Error::Closed)).
    #[must_use]
    pub fn upgrade(&self) -> Option<Bus<T>> {
        self.inner.upgrade().map(|inner| Bus { inner })
    }
}

impl<T> Bus<T> {
    /// A handle that does not keep the bus alive: what a handler that
    /// publishes to (or otherwise acts on) its own bus should own, above
    /// all a detached one, which would otherwise keep the bus alive for
    /// good. See [`WeakBus`].
    #[must_use]
    pub fn downgrade(&self) -> WeakBus<T> {
        WeakBus {
            inner: Arc::downgrade(&self.inner),
        }
    }
}

impl<T> Clone for WeakBus<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Weak::clone(&self.inner),
        }
    }
}

impl<T> fmt::Debug for WeakBus<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakBus")
            .field("alive", &(self.inner.strong_count() > 0))
            .finish()
    }
}
