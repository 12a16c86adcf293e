//! Imports: the interest table, the reconciler that keeps the upstream
//! subscriptions equal to it, and the delivery of what comes in.
//!
//! The bus tells the table when a distinct filter gains its first or loses
//! its last local subscriber (`registry::trie::Interest`); the table keeps
//! a signed count per filter (the *desired* set) and the filters changed
//! since the reconciler last looked, and wakes it. The reconciler compares
//! each changed filter's count with the upstream subscriptions it holds
//! (the *actual* set) and subscribes or unsubscribes. A subscribe/
//! unsubscribe storm on one filter therefore coalesces into at most one
//! change upstream, and the table's memory is one entry per distinct
//! filter.
//!
//! A local filter `L` gets one upstream subscription per import `I` it
//! overlaps, on the filter `L ∩ I`. A message arriving on it is delivered
//! to `L`'s subscribers only (never to other filters', which have their own
//! upstream subscriptions: a broker sends one copy per matching
//! subscription), and only if `I` is the first import that matches its
//! topic (so overlapping imports do not deliver it twice).
//!
//! Every message an upstream subscription hands the bridge is delivered
//! (`received`), found to be an echo or undecodable (`echoes`,
//! `decode_errors`), reached no subscriber because its local filter has
//! none left (not counted: nothing was lost), or is counted `dropped`:
//! - when the filter's queue is full, as a slow consumer too;
//! - when the local bus refuses it;
//! - at close: the reconciler stops the delivery tasks (each after the
//!   delivery in progress), then closes every upstream subscription, which
//!   hands on what its client still holds (`Upstream::close`), and waits
//!   for both; what reaches a queue after that point, and what the queues
//!   still hold, is counted dropped, so the counts are final when `close`
//!   returns (unless it ran out of time).

use std::sync::{Arc, Mutex};

use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::{mpsc, watch, Notify};
use tokio::task::JoinHandle;

use super::codec::{decode_caught, Codec};
use super::mapping::intersect;
use super::stats::Counters;
use super::transport::{Arrival, Deliver, Transport, Upstream};
use crate::bus::Bus;
use crate::registry::trie::Interest;
use crate::sync::Ordering;
use crate::topic::matches;

#[derive(Default)]
struct Desired {
    counts: FxHashMap<Arc<str>, isize>,
    dirty: FxHashSet<Arc<str>>,
}

/// The desired set, fed by the bus.
#[derive(Default)]
pub(crate) struct Table {
    desired: Mutex<Desired>,
    pub(crate) wake: Notify,
}

impl Interest for Table {
    fn changed(&self, filter: &Arc<str>, gained: bool) {
        {
            let mut desired = self.desired.lock().unwrap_or_else(|e| e.into_inner());
            let count = desired.counts.entry(Arc::clone(filter)).or_insert(0);
            *count += if gained { 1 } else { -1 };
            if *count == 0 {
                desired.counts.remove(filter);
            }
            desired.dirty.insert(Arc::clone(filter));
        }
        self.wake.notify_one();
    }
}

impl Table {
    /// The filters changed since the last call, each with whether it is
    /// wanted now.
    fn take_changes(&self) -> Vec<(Arc<str>, bool)> {
        let mut desired = self.desired.lock().unwrap_or_else(|e| e.into_inner());
        let Desired { counts, dirty } = &mut *desired;
        dirty
            .drain()
            .map(|filter| {
                let wanted = counts.get(&filter).is_some_and(|&n| n > 0);
                (filter, wanted)
            })
            .collect()
    }
}

/// What an upstream subscription's messages need to reach the bus.
pub(crate) struct Importer<T> {
    pub(crate) bus: Bus<T>,
    pub(crate) imports: Arc<[Arc<str>]>,
    pub(crate) codec: Arc<dyn Codec<T>>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) origin: Arc<str>,
    /// Messages queued per local filter before they are dropped as a slow
    /// consumer.
    pub(crate) import_buffer: usize,
    /// Set when the bridge stops: the delivery tasks end.
    pub(crate) stopped: watch::Sender<bool>,
}

impl<T: Send + Sync + 'static> Importer<T> {
    /// Delivers one message that arrived on the upstream subscription for
    /// local filter `filter` within import number `import`.
    fn deliver(&self, filter: &str, import: usize, message: Arrival) {
        let message = message.decode();
        if message.origin.as_deref() == Some(&*self.origin) {
            Counters::add(&self.stats.echoes, 1);
            return;
        }
        let Some(topic) = message.topic else {
            Counters::add(&self.stats.decode_errors, 1);
            tracing::warn!(subject = %message.raw_subject, "bridge: a subject that is no topic name of this mapping; dropped");
            return;
        };
        if crate::topic::validate_topic(&topic).is_err() {
            Counters::add(&self.stats.decode_errors, 1);
            tracing::warn!(%topic, "bridge: an invalid topic name; dropped");
            return;
        }
        // The engine's matching is not MQTT's (`$` topics, for one), and
        // another import may own this topic: deliver only what is ours.
        if !matches(filter, &topic)
            || !matches(&self.imports[import], &topic)
            || self.imports[..import].iter().any(|i| matches(i, &topic))
        {
            return;
        }
        let value = match decode_caught(&*self.codec, message.payload) {
            Ok(value) => value,
            Err(error) => {
                Counters::add(&self.stats.decode_errors, 1);
                tracing::warn!(%topic, %error, "bridge: a payload that does not decode; dropped");
                return;
            }
        };
        match self
            .bus
            .deliver_imported(filter, &topic, value, message.metadata)
        {
            Ok(0) => {
                tracing::debug!(%topic, "bridge: an import whose local subscribers all left; not delivered");
            }
            Ok(_) => Counters::add(&self.stats.received, 1),
            Err(error) => {
                Counters::add(&self.stats.dropped, 1);
                tracing::debug!(%topic, %error, "bridge: the local bus refused an import");
            }
        }
    }
}

/// Keeps the upstream subscriptions equal to the table until `stop`.
pub(crate) async fn reconcile<T: Send + Sync + 'static>(
    table: Arc<Table>,
    transport: Arc<dyn Transport>,
    importer: Arc<Importer<T>>,
    stop: Arc<Notify>,
) {
    // Also when this task is aborted (`Bridge`'s drop, or a close that
    // timed out), not only when it returns.
    let _stop_deliveries = StopDeliveries(&importer.stopped);
    let mut actual: FxHashMap<Arc<str>, Subscribed> = FxHashMap::default();
    loop {
        for (filter, wanted) in table.take_changes() {
            let held = actual.contains_key(&filter);
            if wanted && !held {
                let subscribed = subscribe_filter(&*transport, &importer, &filter).await;
                actual.insert(filter, subscribed);
            } else if !wanted && held {
                // Its delivery task ends by itself once its queue is empty
                // and every upstream subscription (every sender) is gone.
                actual.remove(&filter);
            }
        }
        let count: usize = actual.values().map(|s| s.upstreams.len()).sum();
        importer
            .stats
            .upstream_subscriptions
            .store(count as u64, Ordering::Relaxed);
        tokio::select! {
            () = table.wake.notified() => {}
            () = stop.notified() => break,
        }
    }
    // Closing: the deliveries stop first, so what the upstream subscriptions
    // hand on from here is counted dropped, never delivered.
    importer.stopped.send_replace(true);
    let mut closing = Vec::new();
    let mut deliveries = Vec::new();
    for (_, subscribed) in actual.drain() {
        // Each starts unsubscribing when called.
        closing.extend(subscribed.upstreams.into_iter().map(Upstream::close));
        deliveries.push(subscribed.delivery);
    }
    for upstream in closing {
        upstream.await;
    }
    for delivery in deliveries {
        // Err only if the runtime is shutting down.
        let _ = delivery.await;
    }
    importer
        .stats
        .upstream_subscriptions
        .store(0, Ordering::Relaxed);
}

/// What the reconciler holds for one local filter.
struct Subscribed {
    upstreams: Vec<Box<dyn Upstream>>,
    /// The filter's delivery task.
    delivery: JoinHandle<()>,
}

/// Ends the delivery tasks when dropped.
struct StopDeliveries<'a>(&'a watch::Sender<bool>);

impl Drop for StopDeliveries<'_> {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

/// The upstream subscriptions for local filter `filter`: one per import it
/// overlaps. Their messages go through one bounded queue per filter, read
/// by a delivery task of the filter's own: the transport's reader never
/// waits for local handlers (an `Inline` handler that blocks), and what
/// does not fit is dropped and counted exactly, as a slow consumer. One
/// queue per filter keeps each topic's order.
async fn subscribe_filter<T: Send + Sync + 'static>(
    transport: &dyn Transport,
    importer: &Arc<Importer<T>>,
    filter: &Arc<str>,
) -> Subscribed {
    let (queue, mut incoming) = mpsc::channel::<(usize, Arrival)>(importer.import_buffer);
    let mut upstreams = Vec::new();
    for (index, import) in importer.imports.iter().enumerate() {
        let Some(upstream_filter) = intersect(filter, import) else {
            continue;
        };
        let queue = queue.clone();
        let stats = Arc::clone(&importer.stats);
        let local = Arc::clone(filter);
        let stopped = importer.stopped.subscribe();
        let deliver: Deliver = Arc::new(move |message| match queue.try_send((index, message)) {
            Ok(()) => {}
            // A full queue at close (the delivery task finishing its last
            // delivery before it closes the queue) is no slow consumer.
            Err(mpsc::error::TrySendError::Full(_)) if *stopped.borrow() => {
                Counters::add(&stats.dropped, 1);
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                Counters::add(&stats.slow_consumers, 1);
                Counters::add(&stats.dropped, 1);
                tracing::debug!(filter = %local, "bridge: import queue full (slow consumer); message dropped");
            }
            // The delivery task has stopped (the bridge is closing).
            Err(mpsc::error::TrySendError::Closed(_)) => Counters::add(&stats.dropped, 1),
        });
        match transport.subscribe(&upstream_filter, deliver).await {
            Ok(upstream) => upstreams.push(upstream),
            Err(error) => {
                tracing::warn!(filter = %upstream_filter, %error, "bridge: could not subscribe upstream");
            }
        }
    }
    // Ends once every upstream subscription (and so every sender) is gone.
    drop(queue);
    let target = Arc::clone(importer);
    let local = Arc::clone(filter);
    let mut stopped = importer.stopped.subscribe();
    let delivery = tokio::spawn(async move {
        loop {
            let next = tokio::select! {
                biased;
                _ = stopped.wait_for(|&stopped| stopped) => break,
                next = incoming.recv() => next,
            };
            let Some((index, message)) = next else { break };
            target.deliver(&local, index, message);
        }
        // Stopped: these came in but will never reach a subscriber. After
        // `close`, a sender cannot queue more, and `recv` returns `None`
        // once the queue is empty and no send is under way (`try_recv`
        // could miss one under way, which would then be dropped uncounted).
        incoming.close();
        let mut left = 0;
        while incoming.recv().await.is_some() {
            left += 1;
        }
        Counters::add(&target.stats.dropped, left);
    });
    Subscribed {
        upstreams,
        delivery,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeliveryMode;

    #[derive(Default)]
    struct Log(Mutex<Vec<(String, bool)>>);
    impl Interest for Log {
        fn changed(&self, filter: &Arc<str>, gained: bool) {
            self.0.lock().unwrap().push((filter.to_string(), gained));
        }
    }

    #[test]
    fn the_bus_reports_first_and_last_visible_subscribers_only() {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let before = bus.subscribe("a/b", |_| {}).unwrap();
        let log = Arc::new(Log::default());
        let watcher: Arc<dyn Interest> = Arc::clone(&log) as Arc<dyn Interest>;
        let start = bus.inner.trie.watch(Arc::clone(&watcher));
        assert_eq!(start.iter().map(|f| &**f).collect::<Vec<_>>(), ["a/b"]);

        // A tap is not interest, and is no subscription of the bus.
        let tap = bus.subscribe_tap("x/#", 4, Box::new(|_| true)).unwrap();
        assert_eq!(bus.subscriptions_count(), 1);
        let first = bus.subscribe("x/#", |_| {}).unwrap();
        let second = bus.subscribe("x/#", |_| {}).unwrap();
        drop(first);
        drop(second);
        drop(tap);
        let stream = bus.subscribe_stream("x/#").unwrap();
        drop(before);
        drop(stream);
        assert_eq!(
            *log.0.lock().unwrap(),
            [
                ("x/#".to_string(), true),
                ("x/#".to_string(), false),
                ("x/#".to_string(), true),
                ("a/b".to_string(), false),
                ("x/#".to_string(), false),
            ]
        );
        bus.inner.trie.unwatch(&watcher);
        let _after = bus.subscribe("y", |_| {}).unwrap();
        assert_eq!(log.0.lock().unwrap().len(), 5, "unwatched");
    }

    /// An import whose local filter lost its last subscriber before the
    /// delivery reached nobody: it is not counted as received.
    #[test]
    fn an_import_that_reaches_no_subscriber_is_not_received() {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let importer = Importer {
            bus: bus.clone(),
            imports: vec![Arc::<str>::from("a/#")].into(),
            codec: Arc::new(crate::bridge::Json),
            stats: Arc::default(),
            origin: Arc::from("here"),
            import_buffer: 4,
            stopped: watch::channel(false).0,
        };
        let incoming = || -> Arrival {
            crate::bridge::transport::Incoming {
                topic: Some("a/x".into()),
                raw_subject: "a.x".into(),
                payload: bytes::Bytes::from_static(b"1"),
                metadata: None,
                origin: Some("there".into()),
            }
            .into()
        };
        let received = |i: &Importer<u32>| i.stats.received.load(Ordering::Relaxed);
        let sub = bus.subscribe("a/#", |_| {}).unwrap();
        importer.deliver("a/#", 0, incoming());
        assert_eq!(received(&importer), 1);
        drop(sub);
        importer.deliver("a/#", 0, incoming());
        assert_eq!(received(&importer), 1);
        assert_eq!(importer.stats.dropped.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn imported_messages_reach_one_filter_and_skip_taps() {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .build()
            .unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let h = Arc::clone(&hits);
        let _hash = bus
            .subscribe("a/#", move |_| {
                h.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .unwrap();
        let _plus = bus.subscribe("a/+", |_| panic!("not this filter")).unwrap();
        let mut tap = bus.subscribe_tap("a/#", 4, Box::new(|_| true)).unwrap();
        assert_eq!(bus.deliver_imported("a/#", "a/x", 1, None).unwrap(), 2);
        assert_eq!(hits.load(std::sync::atomic::Ordering::Relaxed), 1);
        // The tap sees it, marked imported (so the exporter skips it).
        assert!(tap.try_recv().unwrap().is_imported());
        assert_eq!(
            bus.deliver_imported("none/+", "none/x", 1, None).unwrap(),
            0
        );
    }
}
