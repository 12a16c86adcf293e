//! Handler subscriptions: the [`Subscription`] handle.
//!
//! # Contract
//! - A handler is called once per matching message, from whichever thread the
//!   delivery mode picks (a worker, a tokio task, or the publisher itself), so
//!   it must be `Send + Sync`. Handlers of one subscription may run
//!   concurrently for different messages, and **handler subscriptions make no
//!   ordering promise** (as in BlazeSub); use a stream subscription when order
//!   matters.
//! - A handler that panics is caught and counted in `Stats::handler_panics`;
//!   the worker, the other subscribers and the publisher carry on.
//! - A [`Subscription`] lives until it is dropped or
//!   [`unsubscribe`](Subscription::unsubscribe)d. When either returns, no
//!   delivery to it that had not already started will run, including ones
//!   queued before; a handler call already running may finish. A delivery
//!   *starts* when it checks the subscription's flag, immediately before
//!   calling the handler (unsubscribing does not wait for running handlers,
//!   so a handler may unsubscribe itself);
//!   [`unsubscribe_and_wait`](Subscription::unsubscribe_and_wait) waits for
//!   them (see `registry/quiesce.rs` for how). Once they have finished, the
//!   handler closure is dropped, at once if its filter has 64 subscriptions
//!   or fewer (or with `unsubscribe_and_wait`, whatever their number);
//!   with more, once half of them have left, when the filter's set is
//!   compacted (a compaction per removal would make churn on a large filter
//!   quadratic). [`detach`](Subscription::detach) keeps it for the life of
//!   the bus.
//! - The handle reaches its entry through `EntryControl` and its trie,
//!   weakly, through `Registry`: it never keeps the bus alive. It holds the
//!   bus's [`Quiescence`] strongly (a few counters, no bus): a pool worker
//!   or task may still be inside the handler after the last `Bus` handle is
//!   dropped, and `unsubscribe_and_wait` must still wait for it.

use std::fmt;
use std::sync::{Arc, Weak};

use crate::registry::entry::Control;
use crate::registry::quiesce::Quiescence;
use crate::registry::{Kind, Registry};

/// A live subscription. Dropping it unsubscribes.
///
/// ```
/// use blazesub::{Bus, DeliveryMode, Message};
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::sync::Arc;
///
/// let bus = Bus::<u64>::builder().delivery(DeliveryMode::Inline).build()?;
/// let seen = Arc::new(AtomicU64::new(0));
/// let counter = seen.clone();
/// let sub = bus.subscribe("jobs/+/done", move |_: &Message<u64>| {
///     counter.fetch_add(1, Ordering::Relaxed);
/// })?;
/// assert_eq!(sub.filter(), "jobs/+/done");
///
/// bus.publish("jobs/7/done", 7)?;
/// sub.unsubscribe();
/// bus.publish("jobs/8/done", 8)?; // nobody listens any more
/// assert_eq!(seen.load(Ordering::Relaxed), 1);
/// # Ok::<(), blazesub::Error>(())
/// ```
#[must_use = "dropping a Subscription unsubscribes it at once; call .detach() to keep it for the life of the bus"]
pub struct Subscription {
    entry: Control,
    id: u64,
    /// Shared with the trie node: no allocation per subscription.
    filter: Arc<str>,
    /// What every handle of its bus shares (one pointer where three would
    /// make each handle 16 bytes larger).
    links: Arc<Links>,
    kind: Kind,
    /// In a shared group (`$share/...`) rather than the trie.
    in_group: bool,
    armed: bool,
}

/// What the handles of one bus share.
pub(crate) struct Links {
    /// The bus's runners, strongly: they can outlive the bus's handles.
    quiescence: Arc<Quiescence>,
    /// The trie, weakly: a handle does not keep the bus alive.
    trie: Weak<dyn Registry>,
    /// The shared groups, weakly.
    groups: Weak<dyn Registry>,
}

impl Links {
    pub(crate) fn new(
        quiescence: Arc<Quiescence>,
        trie: Weak<dyn Registry>,
        groups: Weak<dyn Registry>,
    ) -> Self {
        Self {
            quiescence,
            trie,
            groups,
        }
    }
}

impl Subscription {
    /// The handle on entry `id`, subscribed under `filter` in the trie or,
    /// `in_group`, in a shared group.
    pub(crate) fn new(
        entry: Control,
        id: u64,
        filter: Arc<str>,
        links: Arc<Links>,
        in_group: bool,
        kind: Kind,
    ) -> Self {
        Self {
            entry,
            id,
            filter,
            links,
            kind,
            in_group,
            armed: true,
        }
    }

    /// Takes the entry out of the trie (or, with the bus gone, just clears
    /// its flag); `compact` also rebuilds its set so the entry is released
    /// at once.
    fn remove(&self, compact: bool) {
        let registry = if self.in_group {
            &self.links.groups
        } else {
            &self.links.trie
        };
        match registry.upgrade() {
            Some(registry) => {
                registry.remove(&self.filter, self.kind, &*self.entry, self.id);
                if compact {
                    registry.compact(&self.filter, self.kind);
                }
            }
            None => {
                self.entry.deactivate();
            }
        }
    }

    /// The subscription's id, unique within its bus.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The filter it subscribed with.
    pub fn filter(&self) -> &str {
        &self.filter
    }

    /// Unsubscribes (the same as dropping it, but explicit).
    ///
    /// When it returns, no delivery to this subscription that had not yet
    /// started will run, queued ones included. A delivery *starts* when it
    /// checks the subscription's flag, just before calling the handler, so a
    /// handler call that passed that check on another thread may still be
    /// running, or just about to enter the handler, when this returns. It
    /// does not wait for them (a handler may unsubscribe itself); use
    /// [`Self::unsubscribe_and_wait`] to know that none is left. The handler
    /// closure is dropped once those calls have finished if its filter has
    /// 64 subscriptions or fewer; with more, once half of them have left
    /// (`unsubscribe_and_wait` drops it at once, whatever their number).
    pub fn unsubscribe(self) {
        drop(self);
    }

    /// Unsubscribes now, then waits until no call of this handler is
    /// running: every delivery that had started has returned (for an async
    /// handler, its future has completed or been dropped). After it returns,
    /// the handler will never be called again, and unless a running publish
    /// still holds the set it sat in, its closure has been dropped.
    ///
    /// The unsubscribe happens when this is called, not when the future is
    /// first polled. Cancel-safe: dropping the future stops only the waiting.
    /// A handler that unsubscribes itself this way does not wait for itself:
    /// an async handler may `.await` it; calls on the awaiting thread's own
    /// stack are not waited for. The wait may last longer than the handler's
    /// own calls: it waits for every runner that was delivering anything when
    /// it began (runners report per batch, not per delivery, which keeps
    /// delivery cheap; a sync ordered handler's runner that publishers keep
    /// feeding reports again between its catch-up rounds). One consequence,
    /// known and not yet designed away: **two handlers that block on it at
    /// once** (each on its own subscription, on two threads; or two async
    /// handlers finished in place at the task cap) wait for each other's
    /// runner forever. In a handler, [`Self::unsubscribe`] (which does not
    /// wait) is safe.
    ///
    /// ```
    /// # #[tokio::main] async fn main() -> Result<(), blazesub::Error> {
    /// use blazesub::Bus;
    /// use std::sync::atomic::{AtomicU64, Ordering};
    /// use std::sync::Arc;
    ///
    /// let bus = Bus::<u32>::builder().build()?;
    /// let calls = Arc::new(AtomicU64::new(0));
    /// let counter = Arc::clone(&calls);
    /// let sub = bus.subscribe("jobs", move |_| {
    ///     std::thread::sleep(std::time::Duration::from_millis(5));
    ///     counter.fetch_add(1, Ordering::SeqCst);
    /// })?;
    /// bus.publish("jobs", 1)?;
    /// sub.unsubscribe_and_wait().await;
    /// // Whatever ran has finished, and nothing more will.
    /// let seen = calls.load(Ordering::SeqCst);
    /// bus.publish("jobs", 2)?;
    /// bus.close().await?;
    /// assert_eq!(calls.load(Ordering::SeqCst), seen);
    /// # Ok(()) }
    /// ```
    pub fn unsubscribe_and_wait(
        mut self,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        if std::mem::take(&mut self.armed) {
            self.remove(true);
        }
        let running = self.entry.running();
        // Waited for even with the bus gone: its workers and tasks may still
        // be inside the handler (the flag is cleared, so none starts a call).
        let quiescence = Arc::clone(&self.links.quiescence);
        drop(self);
        async move {
            quiescence.wait_for_readers().await;
            if let Some(running) = running {
                running.wait_idle().await;
                running.removed();
            }
        }
    }

    /// Unsubscribes now, leaving an inert handle.
    pub(crate) fn remove_now(&mut self) {
        if std::mem::take(&mut self.armed) {
            self.remove(false);
        }
    }

    /// Keeps the subscription for as long as the bus lives, without a handle.
    pub fn detach(mut self) {
        self.armed = false;
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.remove_now();
    }
}

impl fmt::Debug for Subscription {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("id", &self.id())
            .field("filter", &self.filter())
            .field("armed", &self.armed)
            .finish()
    }
}
